"""Search by text over an image index: a text tower trained onto the locked image embedder (LiT), so the index's
vectors stay as they are.

- ``tokens``: captions and queries as token ids (the ``tokenizers`` wheel), bounded before any work; no torch.
- ``text_onnx``: ``TextEmbedder``, the exported tower on onnxruntime, and ``check_text_model`` (the image model it
  was trained for must be the index's); no torch.
- ``text_index``: the text model an index records in index.json (`retrieval index text`), found again by its hash
  after a move and checked against the index's image model (its declared-compatible models too); no torch.
- ``keywords``: the keyword index's read side (SQLite FTS5 beside a folder index): safe queries, ``KeywordSearch``.
- ``fusion``: the vector and keyword hits of a text query as one ranked list, each hit's source.
- ``text_search``: the one answer to text queries (CLI and server): vectors and keywords, fused.
- ``class_texts``: ImageNet's 1,000 classes as text (WordNet lemmas and definitions timm ships, the classifier's row
  order) and the prompt sets a zero-shot tower is trained on; no torch.
- ``sibling_text``: the text tower an image model names in its metadata (``text_model``), found beside it and
  recorded in an index at build; the metadata keys of a tower's origin; no torch.
- ``encoder``: ``SentenceEncoder``, a BERT sentence encoder (all-MiniLM-L6-v2) in plain PyTorch.
- ``tower``: ``TextTower``, the encoder and a projection into the image space, L2-normalised.
- ``lit_loss``: ``LiTLoss``, the symmetric InfoNCE with a learned temperature.
- ``gallery_adapt``: a zero-shot tower adapted to a gallery with pseudo-captions (a ridge map in the image space,
  closed form) and written as a new text.onnx; numpy and onnx, no torch.
- ``gallery_index``: that adaptation for an index folder (a seeded sample of its stored vectors), recorded when it
  measures no worse on held-out pseudo-captions.
- ``no_match``: the per-index floor under which a text query's answer says "no good match", calibrated when a text
  model is recorded, on ``no_match_texts`` (everyday texts of many domains); numpy only.
"""
