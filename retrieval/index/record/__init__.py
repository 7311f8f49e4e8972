"""The typed record of an index folder's ``index.json``: read from the file's JSON in one place and passed through the
core instead of the dict.

- ``index_info``: ``IndexInfo`` (its format version, the model, the text model, the catalogue, the faiss part and the
  calibrations), ``from_json`` / ``to_json`` giving back the file's keys, order and values exactly.
"""
