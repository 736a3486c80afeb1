"""The methods, by name: the one list that the tools, flower/ and the tests use, each method's
record (its file's METHOD, a common.Method), and what a federated node may run for it."""
import importlib

METHODS = ("fedavg", "fediir", "fedomg", "fedloe", "perinvfl", "fedipg")


def method(name):
    """The record of the method `name` (one of METHODS): its file's METHOD."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return importlib.import_module(name).METHOD


def qualified(fn):
    """A function by its full name, "module:qualname" (fediir:client_update)."""
    return f"{fn.__module__}:{fn.__qualname__}"


def client_functions(record, evaluate_only=False, args=None):
    """What a node may run for a run of a method (a record, or a name of METHODS) with the
    arguments `args`: the client functions its record declares (`clients`, or those it declares
    for these arguments: none without them; its `evaluations`) and its init_state (a node builds
    the method's state as the server does), as "module:qualname"; an evaluation-only node its
    evaluations alone (and the setup). Nothing else."""
    record = method(record) if isinstance(record, str) else record
    setup = (record.init_state,) if record.init_state else ()
    work = () if evaluate_only else run_clients(record, args)
    return frozenset(qualified(fn) for fn in work + record.evaluations + setup)


def run_clients(record, args):
    """The client functions a run of the method `record` with `args` passes to on_clients (its
    `clients`, resolved where they follow from the arguments; () without them)."""
    if callable(record.clients):
        return tuple(record.clients(args)) if args is not None else ()
    return tuple(record.clients)
