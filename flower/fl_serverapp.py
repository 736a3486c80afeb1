"""The ServerApp: run config `method` (one of harness.METHODS) and `argv` (that method's
command-line flags, as one string) -> the method file's own run, its clients' work on the nodes.
Optional: `wait` (seconds for the nodes to connect), `keys` (a folder on the server holding each
node's node-K.pub: a node then holds the partition its registered key was made for) and
`evaluators` (the evaluation sites, default one for a held-out domain, none for fixed clients),
`secagg` (true: every exchange of which the server needs only the sum reaches it as that sum
alone, by Flower's SecAgg+: flower/secagg.py) and `secagg-clip` (no value a client sums may lie
outside ±secagg-clip: its node refuses the round; default 1024).
The server reads no data: each node reads its own folder (node config `data`).

A run that ends in an error (a bad reply, bad flags, a non-finite number) raises
fl_adapter.RunFailed with its one line: Flower marks the run failed at once, with that line as
its details, and `flwr run --stream` shows it; <out>.flower.json holds it as "error"."""
import shlex

from flwr.serverapp import ServerApp

import fl_adapter  # (first: it puts the checkout on the path)
import secagg
from harness.methods import METHODS

app = ServerApp()


@app.main()
def main(grid, context):
    method = str(context.run_config["method"])
    if method not in METHODS:
        raise fl_adapter.RunFailed(f"unknown method {method!r}; choose from "
                                   f"{', '.join(METHODS)}")
    argv = shlex.split(str(context.run_config.get("argv", "")))
    keys = str(context.run_config.get("keys", "")) or None
    evaluators = str(context.run_config.get("evaluators", ""))
    on = str(context.run_config.get("secagg", False)).lower() == "true"
    clip = float(context.run_config.get("secagg-clip", secagg.CLIP)) if on else None
    if clip is not None and not 0 < clip < float("inf"):
        raise fl_adapter.RunFailed(f"secagg-clip must be a positive number, got {clip:g}")
    fl_adapter.serve(grid, method, argv, float(context.run_config.get("wait", 600)), keys,
                     int(evaluators) if evaluators.strip() else None, clip)
