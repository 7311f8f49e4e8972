"""Start the Gradio app (and the HTTP API) on the demo artifacts that `make demo` builds.

    python app.py                                   # artifacts/demo/index + artifacts/demo/run/report.json
    python app.py --index INDEX_DIR --report REPORT.json [--host HOST] [--port PORT]

Same options as `retrieval serve`; see `python app.py --help`.
"""

from retrieval.cli.serve import serve_command

if __name__ == "__main__":
    serve_command(prog_name="python app.py")
