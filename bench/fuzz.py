"""A fast mutation fuzzer for the codec and the manifest parser (no hypothesis overhead).

    python -m bench.fuzz [--n 100000] [--seed 0]

Feeds ``n`` inputs to each of ``codec.decode`` and ``parse_manifest``:
mutated valid objects (byte flips, truncations, insertions, deletions, header
field overwrites; half of them re-sealed with valid checksums, ``codec.reseal``,
so the checks behind the checksum run too) and random bytes. Every input must end in
a decoded object or a typed error (``CorruptObjectError`` /
``RestoreMismatchError`` / ``ManifestError``); anything else is a failure,
printed with the input, and the exit status is 1. Prints the counts.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter

import torch

from consistency.manifest import parse_manifest
from tierstore import codec
from tierstore.errors import CorruptObjectError, ManifestError, RestoreMismatchError

TRAILER = codec.TRAILER_SIZE


def _seeds() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    objs = [
        {"w": torch.randn(8, 8, generator=g), "b": torch.arange(5), "m": torch.rand(3, generator=g) > 0.5},
        {"h": torch.randn(4, generator=g).half(), "s": torch.tensor(3.0), "e": torch.empty(0, 2)},
        {"bf": torch.randn(2, 3, generator=g).bfloat16(), "u": torch.arange(6, dtype=torch.uint8).reshape(2, 3)},
    ]
    out = [codec.encode(o, {"step": 1, "note": "x" * 20}) for o in objs]
    out.append(codec.encode({"z": torch.zeros(4096)}, compress="always"))
    return out


def _reseal(b: bytearray) -> bytes:
    return codec.reseal(b)  # valid checksums (chunk digests and trailer) over the mutated bytes


def _mutate(rng: random.Random, blob: bytes) -> bytes:
    b = bytearray(blob)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and len(b) > 1:
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 16)]
        elif op == 4 and len(b) >= codec.HEADER.size:
            off = rng.choice([6, 8, 12, 20, 28, 32])  # flags, table_len, data_len, raw_len, chunk_size, n_chunks
            width = 2 if off == 6 else (4 if off in (8, 28, 32) else 8)
            b[off:off + width] = rng.choice([b"\xff" * width, b"\x00" * width, rng.randbytes(width)])
        elif op == 5:
            i = rng.randrange(max(1, len(b)))
            b[i:i + 8] = rng.randbytes(8)
    return _reseal(b) if rng.random() < 0.5 else bytes(b)


def _manifest_inputs(rng: random.Random) -> str | bytes:
    base = {"version": 1, "model": "m", "step": 3, "world": 2, "epoch": 1, "layout": {"layers": ["a"]},
            "ranks": {str(r): {"objects": [{"key": f"m/a/3/{r}", "kind": "full", "size": 10, "checksum": "ab",
                                            "base": None, "target": None, "tiers": ["host"]}], "extra": {}}
                      for r in range(2)}}
    text = json.dumps(base)
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randint(0, 200))
    if choice == 1:
        b = bytearray(text.encode())
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    m = json.loads(text)
    victim = rng.choice(["version", "model", "step", "world", "ranks", "layout"])
    m[victim] = rng.choice([None, True, -1, 2**70, "x", [], {}, 1.5, "../x"])
    if choice == 3:
        o = m["ranks"]["0"]["objects"][0] if isinstance(m.get("ranks"), dict) and "0" in m["ranks"] else {}
        if o:
            o[rng.choice(["key", "kind", "size", "checksum", "base", "target"])] = rng.choice(
                [None, True, -5, "m/a/3", "other/a/3/0", "m/a/3/0", "delta", "ref", 2**80])
    return json.dumps(m)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    seeds = _seeds()
    outcomes: Counter[str] = Counter()
    bad = 0
    t0 = time.perf_counter()
    for i in range(a.n):
        blob = rng.randbytes(rng.randint(0, 300)) if i % 10 == 0 else _mutate(rng, rng.choice(seeds))
        try:
            codec.decode(blob)
            outcomes["codec: decoded"] += 1
        except (CorruptObjectError, RestoreMismatchError) as e:
            outcomes[f"codec: {type(e).__name__}"] += 1
        except Exception as e:  # noqa: BLE001 - the finding
            bad += 1
            print(f"codec input {i}: untyped {type(e).__name__}: {e}; input {blob[:80]!r}")
    t_codec = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(a.n):
        raw = _manifest_inputs(rng)
        try:
            parse_manifest(raw)
            outcomes["manifest: accepted"] += 1
        except ManifestError:
            outcomes["manifest: ManifestError"] += 1
        except Exception as e:  # noqa: BLE001 - the finding
            bad += 1
            print(f"manifest input {i}: untyped {type(e).__name__}: {e}; input {str(raw)[:120]!r}")
    t_man = time.perf_counter() - t0
    print(f"fuzzed {a.n} codec inputs in {t_codec:.1f} s and {a.n} manifest inputs in {t_man:.1f} s (seed {a.seed})")
    for k, v in sorted(outcomes.items()):
        print(f"  {k}: {v}")
    print(f"untyped failures: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
