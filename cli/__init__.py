"""The ``retrieval`` command line (click). Each area's commands live in their own module here.

- ``main``: the one ``retrieval`` command: train, evaluate, losses, backbones and demo; the areas' commands added.
- ``train_summary``: what ``retrieval train`` says at the end of a run without labels; the index's export.
- ``options``: what the command modules share to declare options.
- ``config_options``: click options made from the options a dataclass declares.
- ``doc_tables``: the docs' tables of the declared options (it reads the whole command line; nothing imports it).
- ``errors``: the command line's errors: a core ``ParameterError`` named by the command's own option.
- ``help_text``: help texts built, when ``--help`` shows them, from the facts they name.
- ``data``: ``retrieval data ...``: the embedded data sets prepared as ImageFolder trees.
- ``analyze``: ``retrieval analyze weights|triplets``.
- ``export``: ``retrieval export``: a checkpoint or a pretrained backbone -> one verified ONNX file (and its int8).
- ``export_next``: what ``retrieval export`` says to run next, read from the model's metadata.
- ``index``: the ``retrieval index`` group, gathered from the modules that hold its commands by job.
- ``index_common``: what the gallery commands share: the index folder, the writers' option groups, a writer run.
- ``index_options``: the gallery commands' options, each declared once.
- ``index_write``: ``retrieval index build|add|remove|repair``.
- ``index_inspect``: ``retrieval index stats|export``.
- ``index_columns``: ``retrieval index columns``: the manifest columns an index keeps and those answers show.
- ``index_text``: ``retrieval index text``: the text model an index records.
- ``index_upgrade``: ``retrieval index upgrade|compare`` and ``retrieval compare``.
- ``index_milvus``: ``retrieval index push``, and the collection kept in step by the writers.
- ``curation``: ``retrieval index duplicates|audit`` and ``retrieval audit``.
- ``search``: ``retrieval search``: by image or by text, from an index folder.
- ``serve``: ``retrieval serve``: the API and the app on one port.
- ``text``: ``retrieval text train``: a text tower trained onto an image model.
- ``results``: ``retrieval results run|report``: the results grid.
- ``runs``: ``retrieval runs compare``: training runs side by side.
- ``demo``: ``retrieval demo`` / ``make demo``: the main job on the emoji data.
"""
