"""The typed records of the JSON that crosses packages (timm's ``PretrainedCfg`` is the pattern): each is read from its
JSON object in one place, passed through the core instead of the dict, and given back as JSON by ``to_json`` only where
the file is written. They import nothing of the project: every layer can take them.

- ``json_object``: ``KeptJson``, the base every record shares (the object's keys, order and values kept), and
  ``FlatJson``, that of a record whose fields are its keys.
- ``index_info``: ``IndexInfo``, an index folder's ``index.json`` (its format version, the model, the text model, the
  catalogue, the faiss part and the calibrations), ``from_json`` / ``to_json`` giving back the file's keys, order and
  values exactly.
- ``model_config``: ``ModelConfig``, a model's config (``Embedder.config``, a checkpoint's ``model_config``, the ONNX
  metadata's ``model_config``).
- ``run_config``: ``RunConfig``, a run's training options (a checkpoint's ``train_config``), and ``RunFolderConfig``,
  its config.json (report.json's ``config``).
"""
