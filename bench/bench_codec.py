"""Micro-benchmark of the codec, XOR deltas and lz4 on checkpoint-like data.

Run: ``python bench/bench_codec.py [--mib 256] [--reps 5]``. Prints medians
(min-max) in ms and GiB/s; the bound is a ``copy_`` of the same tensors into
pre-allocated tensors. The ``v1`` / ``v2`` rows read the same object in format
version 1 (one checksum over everything) and version 2 (a digest per chunk),
alternated rep by rep so that both meet the same load. Standalone: needs only
tierstore, torch, numpy, lz4.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import lz4.block
import lz4.frame
import numpy as np
import torch
import xxhash

from tierstore import codec
from tierstore.delta import apply_xor_delta, xor_delta
from tierstore.train.hashing import digest_many


def timeit(fn: Callable[[], object], reps: int) -> tuple[float, float, float]:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


def row(label: str, t: tuple[float, float, float], nbytes: int, bound: float | None = None) -> None:
    med, lo, hi = t
    ratio = f"  {med / bound:5.2f}x bound" if bound else ""
    print(f"{label:<44} {med * 1e3:8.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f})  {nbytes / med / 2**30:6.2f} GiB/s{ratio}")


def adamw_weights(hidden: int, steps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Two consecutive weight versions of a linear layer trained with AdamW (real updates)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(hidden, hidden)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-4)
    x, y = torch.randn(256, hidden), torch.randn(256, hidden)
    prev = layer.weight.detach().clone()
    for _ in range(steps):
        prev = layer.weight.detach().clone()
        opt.zero_grad()
        torch.nn.functional.mse_loss(layer(x), y).backward()
        opt.step()
    return layer.weight.detach().clone(), prev


def version_1(blob: bytes) -> bytes:
    """The same object in format version 1 (one xxh3-128 over everything, no chunk table), as it was written."""
    info = codec.inspect(blob, verify=False)
    table_at, data_at = codec.HEADER.size, len(blob) - codec.TRAILER_SIZE - info.data_len
    body = (codec.HEADER.pack(codec.MAGIC, 1, 0, info.table_len, info.data_len, info.raw_len)
            + blob[table_at : table_at + info.table_len] + blob[data_at : len(blob) - codec.TRAILER_SIZE])
    return body + xxhash.xxh3_128_digest(body)


def ab_versions(blob: bytes, dst: dict, p: codec.EncodePlan, buf: memoryview, reps: int, nbytes: int,
                bound: float) -> None:
    """Full reads and the seal of version 1 against version 2, alternated rep by rep (same noise for both)."""
    v1 = version_1(blob)
    assert codec.inspect(v1).version == 1 and codec.inspect(blob).version == 2
    end = p.data_offset + p.raw_len
    pairs = [
        ("verify", lambda: codec.verify(v1), lambda: codec.verify(blob)),
        ("decode(out=pre-allocated)", lambda: codec.decode(v1, out=dst), lambda: codec.decode(blob, out=dst)),
        ("decode(copy=False)", lambda: codec.decode(v1, copy=False), lambda: codec.decode(blob, copy=False)),
        ("seal", lambda: xxhash.xxh3_128(buf[:end]).digest(), lambda: p.seal(buf)),
    ]
    for label, f1, f2 in pairs:
        t1, t2 = [], []
        f1(), f2()
        for _ in range(max(reps, 9)):
            for fn, ts in ((f1, t1), (f2, t2)):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
        m1, m2 = statistics.median(t1), statistics.median(t2)
        row(f"  v1 {label}", (m1, min(t1), max(t1)), nbytes, bound)
        row(f"  v2 {label} ({m2 / m1:.2f}x v1)", (m2, min(t2), max(t2)), nbytes, bound)


def lz4_row(label: str, data: bytes, reps: int) -> None:
    n = len(data)
    for name, comp, decomp in [
        ("frame", lambda: lz4.frame.compress(data, block_size=lz4.frame.BLOCKSIZE_MAX4MB),
         lz4.frame.decompress),
        ("block", lambda: lz4.block.compress(data, store_size=False),
         lambda c: lz4.block.decompress(c, uncompressed_size=n)),
    ]:
        c = comp()
        tc = timeit(comp, reps)[0]
        td = timeit(lambda: decomp(c), reps)[0]
        print(f"  {label:<34} lz4 {name}: ratio {len(c) / n:5.3f}  "
              f"compress {n / tc / 2**30:5.2f} GiB/s  decompress {n / td / 2**30:5.2f} GiB/s")


def bitshuffle_ratio(x: np.ndarray) -> float:
    """Reference only: lz4 ratio of a bit-shuffled (not byte-shuffled) XOR delta."""
    bits = np.unpackbits(x.view(np.uint8).reshape(-1, x.itemsize), axis=1)  # (n, 8*itemsize)
    packed = np.packbits(np.ascontiguousarray(bits.T), axis=1).tobytes()
    return len(lz4.frame.compress(packed)) / x.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (fp32)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024, help="linear layer width for the AdamW delta")
    a = ap.parse_args()
    torch.manual_seed(0)
    per = a.mib * 2**20 // 4 // a.tensors
    state = {f"t{i}": torch.randn(per) for i in range(a.tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    print(f"state: {a.tensors} fp32 tensors, {nbytes / 2**20:.0f} MiB; torch threads {torch.get_num_threads()}")

    dst = {k: torch.empty_like(v) for k, v in state.items()}
    bound = timeit(lambda: [dst[k].copy_(v) for k, v in state.items()], a.reps)
    row("copy_ into pre-allocated (bound)", bound, nbytes)
    p = codec.plan(state, {"step": 1})
    buf = memoryview(bytearray(p.nbytes))
    row("plan.write into staging buffer (stall)", timeit(lambda: p.write(buf), a.reps), nbytes, bound[0])
    row("plan.seal (xxh3-128)", timeit(lambda: p.seal(buf), a.reps), nbytes, bound[0])
    row("plan() (validate + layout)", timeit(lambda: codec.plan(state, {"step": 1}), a.reps), nbytes)
    row("encode(compress='never') -> bytes", timeit(lambda: codec.encode(state, compress="never"), a.reps),
        nbytes, bound[0])
    row("encode(compress='auto') (sample, no lz4)", timeit(lambda: codec.encode(state), a.reps), nbytes, bound[0])
    blob = codec.encode(state, compress="never")
    row("verify (checksum + table)", timeit(lambda: codec.verify(blob), a.reps), nbytes, bound[0])
    row("decode(copy=True)", timeit(lambda: codec.decode(blob), a.reps), nbytes, bound[0])
    row("decode(copy=False) (verify + alias)", timeit(lambda: codec.decode(blob, copy=False), a.reps),
        nbytes, bound[0])
    row("decode(out=pre-allocated)", timeit(lambda: codec.decode(blob, out=dst), a.reps), nbytes, bound[0])
    ab_versions(blob, dst, p, buf, a.reps, nbytes, bound[0])
    row("digest_many xxh3 (AdaCheck)", timeit(lambda: digest_many(state), a.reps), nbytes, bound[0])
    row("digest_many blake2s", timeit(lambda: digest_many(state, "blake2s"), 1), nbytes, bound[0])
    blob = buf = p = None  # type: ignore[assignment]  # freed before the next section allocates

    big_new = torch.cat(list(state.values()))
    big_base = big_new + 1e-3 * torch.randn_like(big_new)
    d = xor_delta(big_new, big_base)
    row("xor_delta (byte-shuffled)", timeit(lambda: xor_delta(big_new, big_base), a.reps), nbytes, bound[0])
    row("apply_xor_delta", timeit(lambda: apply_xor_delta(big_base, d), a.reps), nbytes, bound[0])
    row("apply_xor_delta(out=)", timeit(lambda: apply_xor_delta(big_base, d, out=big_new), a.reps),
        nbytes, bound[0])
    row("plain torch XOR on int32 views (no shuffle)",
        timeit(lambda: torch.bitwise_xor(big_new.view(torch.int32), big_base.view(torch.int32)), a.reps),
        nbytes, bound[0])
    big_new = big_base = d = None  # type: ignore[assignment]  # freed

    print(f"lz4 (ratio = compressed/raw; Linear({a.hidden},{a.hidden}) AdamW lr=1e-4, consecutive steps):")
    dense = torch.randn(a.hidden * a.hidden).numpy().tobytes()
    lz4_row("(a) dense fp32 randn", dense, a.reps)
    w1, w0 = adamw_weights(a.hidden)
    shuffled = xor_delta(w1, w0).numpy().tobytes()
    plain = torch.bitwise_xor(w1.view(torch.int32), w0.view(torch.int32))
    lz4_row("(b) byte-shuffled XOR delta", shuffled, a.reps)
    lz4_row("(c) unshuffled XOR delta", plain.numpy().tobytes(), a.reps)
    print(f"  {'(ref) bit-shuffled XOR delta':<34} lz4 frame: ratio {bitshuffle_ratio(plain.numpy()):5.3f}")
    blob = codec.encode({"w": xor_delta(w1, w0)})
    info = codec.inspect(blob)
    print(f"  codec auto on (b): compressed={info.compressed} ratio {info.nbytes / (w1.numel() * 4):5.3f}")


if __name__ == "__main__":
    main()
