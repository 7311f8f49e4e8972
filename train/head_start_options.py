"""The choices of ``--head-start`` and their help, apart from ``head_start.py`` (torch) so that the configuration,
which the command line reads at start-up, declares the option without importing torch."""

from __future__ import annotations

RANDOM, PRINCIPAL, IDENTITY = "random", "principal", "identity"
HEAD_STARTS = ("auto", RANDOM, PRINCIPAL, IDENTITY)  # --head-start; auto: train/head_start.py, measured
HEAD_START_HELP = ("where the head starts: random (the papers' init), principal (the train features' principal axes), "
                   "identity (the pretrained export itself; --embedding-dim = the backbone's feature size).")
HEAD_START_AUTO_TEXT = "auto: identity frozen (principal at other sizes), random fine-tuned, principal without labels"
# without labels the start is the run's fallback (the guard's and the label-free check's): a random head's
# neighbours are no pretrained model's
RANDOM_UNLABELLED = (f"--labels none --head-start {RANDOM}: the start is what the run delivers where no trained "
                          "epoch keeps --kept-floor or the label-free check cannot tell the trained model from it, "
                          f"and a random head is not the pretrained backbone's neighbours: give --head-start "
                          f"{PRINCIPAL} (or leave it out)")
