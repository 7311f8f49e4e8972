"""Start the Gradio app (and the HTTP API) on the demo artifacts that `make demo` builds.

    python app.py                                   # artifacts/demo/index + artifacts/demo/run/report.json
    python app.py --index INDEX_DIR --report REPORT.json [--host HOST] [--port PORT]

Same options as `retrieval serve`; see `python app.py --help`.
"""

import logging

from retrieval.cli.main import show_notices
from retrieval.cli.serve import serve_command

if __name__ == "__main__":
    show_notices(logging.INFO)  # the server's notices on stderr, as `retrieval serve` shows them
    serve_command(prog_name="python app.py")
