"""The ``retrieval`` command line (click). Each area's commands live in their own module here."""
