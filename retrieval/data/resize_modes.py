"""How an image of any shape becomes a model's square input: the modes, recorded in a model config as ``resize``
(standard library only: the command line declares ``--resize`` from them before it imports PIL or NumPy). A model's
mode is ``ModelPreprocessing.resize_mode`` (``retrieval.data.preprocessing``); the pixels each mode gives are
``retrieval.data.eval_preprocess``'s."""

from __future__ import annotations

CROP, PAD = "crop", "pad"
RESIZE_MODES = (CROP, PAD)  # crop: the short side resized, the centre kept; pad: the whole image, letterboxed
# a pretrained backbone exported as it is: pad measured as good as crop on square images and better on every
# catalogue of varied shapes (docs/RESULTS.md, "Resize modes" and "Your own catalogue")
PRETRAINED_RESIZE = PAD
