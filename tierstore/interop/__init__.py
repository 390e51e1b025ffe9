"""Adapters to other formats and frameworks: the DCP storage layer, export and import of weights files.

Built on :mod:`tierstore.train` (the Checkpointer, layers, the state document) and
the data path; :mod:`tierstore.train` never imports this package.

- :mod:`tierstore.interop.dcp`: ``torch.distributed.checkpoint`` StorageWriter and StorageReader;
- :mod:`tierstore.interop.export` / :mod:`tierstore.interop.importing`: safetensors and
  ``torch.save`` files out of and into a model's steps.
"""
