"""Adapters to other formats and frameworks: the DCP storage layer, export and import of weights files.

Built on :mod:`tierstore.train` (the Checkpointer, layers, the state document) and
the data path; :mod:`tierstore.train` never imports this package.

- :mod:`tierstore.interop.dcp`: ``torch.distributed.checkpoint`` StorageWriter and StorageReader;
- :mod:`tierstore.interop.export` / :mod:`tierstore.interop.importing`: safetensors and
  ``torch.save`` files out of and into a model's steps;
- :mod:`tierstore.interop.lightning`: PyTorch Lightning's ``CheckpointIO``, a ``ModelCheckpoint`` whose saves
  go through the Checkpointer's policies, and an FSDP2 strategy that loads through them and saves each rank's
  shards (:mod:`tierstore.interop.lightning_fsdp`);
- :mod:`tierstore.interop.huggingface`: the ``transformers`` Trainer's own save/resume flow;
- :mod:`tierstore.interop.pointer`: the small JSON files both leave where the framework expects its checkpoint.

The framework modules import their framework when imported (``MissingDependencyError`` with the
``pip install`` line when it is missing); nothing else here imports them.
"""
