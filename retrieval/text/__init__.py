"""Search by text over an image index: a text tower trained onto the locked image embedder (LiT), so the index's
vectors stay as they are.

- ``tokens``: captions and queries as token ids (the ``tokenizers`` wheel), bounded before any work; no torch.
- ``text_onnx``: ``TextEmbedder``, the exported tower on onnxruntime, and ``check_text_model`` (the image model it
  was trained for must be the index's); no torch.
- ``text_index``: the text model an index records in index.json (`retrieval index text`), found again by its hash
  after a move and checked against the index's image model (its declared-compatible models too); no torch.
- ``encoder``: ``SentenceEncoder``, a BERT sentence encoder (all-MiniLM-L6-v2) in plain PyTorch.
- ``tower``: ``TextTower``, the encoder and a projection into the image space, L2-normalised.
- ``lit_loss``: ``LiTLoss``, the symmetric InfoNCE with a learned temperature.
"""
