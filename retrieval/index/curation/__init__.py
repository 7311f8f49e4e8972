"""Reading a gallery through its index: near-duplicates, label audit, how a new model changes neighbours.

- ``neighbour_graph``: each image's k nearest other images (what the near-duplicate modules and ``audit`` read).
- ``duplicates``: near-duplicate groups, the summary ``index duplicates`` and the app show.
- ``copy_verification``: candidate pairs from the graph verified as copies; groups that do not chain.
- ``copy_calibration``: the verification's rules and candidate cosine, calibrated on copies planted of the gallery.
- ``copy_planting``: the copies and variants both calibrations plant of gallery images, as people make them.
- ``copy_check``: whether one image is a transformed copy of another (local features, one transform, content, colour).
- ``linked_groups``: the links at a threshold joined into groups, each cut around its first image.
- ``duplicates_threshold``: ``auto``'s threshold, calibrated on copies it plants of gallery images.
- ``catalogued_images``: a catalogued image read by id, which of a group of copies is kept, and the background
  pictures are drawn on.
- ``audit``: images whose label disagrees with their neighbours'.
- ``add_check``: ``index add``'s check of new images against the indexed ones.
- ``compare``: the overlap of each image's neighbours under two models.
"""
