"""No host synchronisation inside a per-step loop: a round of every method (every FedLOE stage and
penalty, FedIPG's two local steps, the clients one after another and at once) with the functions
that hold its per-step loops checked by tests.helpers.SyncGuard, on the CPU and on CUDA where
present. The variants under benchmark/diagnostics: their own test_diagnostics.py."""

import pytest

from tests.helpers import LOE_FULL, guarded_run, on_every_device

SYNTH = ["--dataset", "synthetic", "--test-domain", "1"]
LOE = SYNTH + LOE_FULL + ["--clients", "4", "--stage1-epochs", "1", "--stage1-comms", "1",
                          "--stage2-epochs", "1", "--stage2-comms", "1", "--server-steps", "3"]
LOE_STEPS = ["common.features", "fedloe.overfit_head", "fedloe.fit_phi"]
# The per-step loops: common.local_train (one client) and common.at_once (stacked clients, entered
# through local_train); the client functions around them are checked whole (on CUDA under the
# debug mode too).
ONCE = ["common.local_train", "common.at_once"]
PINV = ["perinvfl.client_update", "common.local_train"]
FEDOMG = SYNTH + ["--rounds", "2", "--sample", "2", "--clients", "3"]

CASES = [                 # method, argv, the functions that hold its per-step loops
    pytest.param("fedavg", SYNTH + ["--rounds", "1", "--parallel-clients", "off"],
                 ["common.local_train"], id="fedavg"),
    pytest.param("fedavg", SYNTH + ["--rounds", "1", "--parallel-clients", "on"], ONCE,
                 id="fedavg-parallel"),
    pytest.param("fediir", SYNTH + ["--rounds", "1", "--parallel-clients", "off"],
                 ["common.local_train", "fediir.classifier_gradient"], id="fediir"),
    pytest.param("fediir", SYNTH + ["--rounds", "1", "--parallel-clients", "on"],
                 ONCE + ["fediir.classifier_gradient"], id="fediir-parallel"),
    pytest.param("fedomg", FEDOMG + ["--parallel-clients", "off"], ["common.local_train"],
                 id="fedomg"),
    pytest.param("fedomg", FEDOMG + ["--parallel-clients", "on"], ONCE, id="fedomg-parallel"),
    pytest.param("fedloe", LOE + ["--dg", "irm", "--parallel-clients", "off"],
                 ["common.local_train"] + LOE_STEPS, id="fedloe-irm"),
    pytest.param("fedloe", LOE + ["--dg", "rex", "--parallel-clients", "on"], ONCE + LOE_STEPS,
                 id="fedloe-rex-parallel"),
    pytest.param("fedloe", LOE + ["--dg", "fish", "--parallel-clients", "off"],
                 ["common.local_train"] + LOE_STEPS, id="fedloe-fish"),
    pytest.param("perinvfl", ["--dataset", "rcmnist", "--rounds", "2", "--S", "2", "--R", "2"],
                 PINV + ["perinvfl.J_i"], id="perinvfl"),
    pytest.param("perinvfl", ["--dataset", "rcmnist", "--rounds", "2", "--S", "2",
                              "--parallel-clients", "on"], PINV + ONCE[1:], id="perinvfl-parallel"),
    pytest.param("fedipg", SYNTH + ["--rounds", "1", "--local-step", "paper"],
                 ["fedipg.full_gradient"], id="fedipg-paper"),
    pytest.param("fedipg", SYNTH + ["--rounds", "1", "--local-step", "sgd",
                                    "--parallel-clients", "off"], ["common.local_train"],
                 id="fedipg-sgd"),
    pytest.param("fedipg", SYNTH + ["--rounds", "1", "--local-step", "sgd",
                                    "--parallel-clients", "on"], ONCE, id="fedipg-sgd-parallel"),
]


@on_every_device
@pytest.mark.parametrize("method,argv,steps", CASES)
def test_every_method_has_no_host_sync_inside_a_per_step_loop(tmp_path, monkeypatch, device, method,
                                                              argv, steps):
    """A round of every method (and every FedLOE stage and penalty) with the functions that hold its
    per-step loops checked by SyncGuard; the skeleton's once-per-round reads (the loss check,
    evaluation, the client draw from the CPU generator) stay outside."""
    guarded_run(method, argv, steps, device, tmp_path, monkeypatch)
