"""The ServerApp: run config `method` (one of fl_adapter.METHODS) and `argv` (that method's
command-line flags, as one string) -> the method file's own run, its clients' work on the nodes."""
import shlex

from flwr.serverapp import ServerApp

import fl_adapter

app = ServerApp()


@app.main()
def main(grid, context):
    method = str(context.run_config["method"])
    if method not in fl_adapter.METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(fl_adapter.METHODS)}")
    argv = shlex.split(str(context.run_config.get("argv", "")))
    _, link = fl_adapter.serve(grid, method, argv, float(context.run_config.get("wait", 600)))
    fl_adapter.report(link)
