"""Small helpers the whole project shares; none but ``reads`` imports torch, and this package imports none of them.

- ``bounded_map``: ``bounded_map``: a function mapped on a thread pool, a bounded number of calls in flight, Ctrl-C
  answered within the calls running.
- ``heap``: ``kept_heap`` (glibc keeps freed blocks through a loop) and ``trim_heap``.
- ``io``: ``atomic_write``, ``read_capped``, ``open_regular``, ``fsync_dir``: files written whole, read bounded.
- ``lazy``: ``lazy_exports``: a package's public names imported on first use (PEP 562).
- ``onnx_hash``: ``proto_model_hash``, ``legacy_model_hash``: an ONNX model's hash, annotations left out.
- ``printable``: ``printable_path``: one readable line for any path (hostile file names in messages).
- ``progress``: ``progress_bar``: tqdm on a terminal, plain lines elsewhere.
- ``reads``: ``Stat``, ``require``, ``read_stats``, ``on_host``, ``to_device``: device values read together (torch).
- ``registry``: ``Registry``: name -> factory, by decorator or by a table of import paths (backbones, losses, data
  sets, augmentations, optimizers).
- ``sizes``: ``size_text``: byte counts in binary units.
- ``unit_rows``: ``l2_normalize_rows``: embedding rows scaled to unit length, in NumPy.
- ``workers``: ``default_workers``, ``default_decode_threads``: the DataLoader workers, and the index writers'
  decoding threads, when none are asked for.
"""
