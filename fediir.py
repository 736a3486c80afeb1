"""FedIIR — Out-of-Distribution Generalization of Federated Learning via Implicit Invariant
Relationships (Yaming Guo, Kai Guo, Xiaofeng Cao, Tieru Wu, Yi Chang; ICML 2023). Official code:
github.com/YamingGuo98/FedIIR (read at commit 3e7a785). f = w ∘ Φ, θ = (φ, ω): model.featurizer,
model.classifier. Each client aligns its classifier gradient with the global one:

    (FEDIIR)   min_θ  E_c [ R_c(θ) + γ/2 ||∇_ω R_c(θ) − ∇_ω R(θ)||² ]

Algorithm 1 (one round t), in the official code's forms (Table 3's numbers come from the code):
  1. sample a subset S of C clients                                 common.sample_clients
  2. θ^{t-1} to S; each c ∈ S sends Σ_ζ ∇_ω R_c(θ^{t-1}; ζ) over its  classifier_gradient:
     minibatches ζ (augmented inputs) and their number; the server   classifier_grads
     g_bar_ω = the mean over every minibatch of S (the code's mean_grad)
     g̃^t = v g̃^{t-1} + (1 − v) g_bar_ω   (Appendix C, g̃^0 = 0)    gbar_update
  3. θ^{t-1}, g̃^t to S; each c: θ_c ← θ^{t-1}, K minibatch steps on  client_update:
     R_c(θ_c; ζ) + γ ||∇_ω R_c(θ_c; ζ) − g̃^t||² (the code: no 1/2)   iir_objective
     and Δ_c = θ_c − θ^{t-1} up (steps 2, 4 use only sums over S)
  4. θ^t = θ^{t-1} + η_g (1/C) Σ_c (θ_c − θ^{t-1})                  server_update
The paper's readings (g_bar over clients, γ/2, data-size weights, g_bar on plain inputs) run in
benchmark/diagnostics/fediir_readings.py.

Defaults: γ from Table 3 (RotatedMNIST 1e-2, VLCS 5e-3, PACS 1e-3, OfficeHome 5e-4, the code's
form), lr / batch from Table 3 (RotatedMNIST 1e-2 / 64); v = 0.95 (Appendix C); 100 rounds, 1
local epoch, SGD momentum 0.9 (the code). Small scenario: one client per training domain, all
sampled (default); large: `--clients 50` (Algorithm 2). Paper against code, measurements, "Copy
it": docs/fediir.md.

    python fediir.py                                  # RotatedMNIST, embedded digits
    python fediir.py --clients 50 --test-domain 0
    python fediir.py --dataset pacs --data-root ./data
"""
import importlib.util
if __name__ == "__main__" and importlib.util.find_spec("harness"):  # the harness first: a Ctrl-C
    import harness  # noqa: F401   while torch loads is one line, exit 130 (harness/__init__.py)
import functools

import torch
import torch.nn.functional as F

import common

DEFAULTS = {"*": dict(gamma=1e-2, ema=0.95),                  # γ: Table 3's RotatedMNIST; v: App. C
            "vlcs": dict(gamma=5e-3), "pacs": dict(gamma=1e-3), "officehome": dict(gamma=5e-4)}


# ---------------------------------------------------------------- the method as plain functions
# Tensors, modules and numbers (no project objects): the classifier gradients a client uploads
# for g_bar, the server's g̃, and the local objective. featurizer Φ and classifier w are the
# model's two modules (ω: the classifier's parameters); gradients over ω are flat vectors in the
# order of classifier.parameters().

def classifier_grads(classifier, z, y, batch_size=None):
    """Step 2 on client c: Σ_ζ ∇_ω R(θ^{t-1}; ζ) of the cross-entropy of the classifier on features
    z = Φ(x) (no graph: only ω needs a gradient here) over its consecutive minibatches ζ of
    batch_size rows (the code's mean_grad; None: one over all of z, the paper's full-batch
    ∇_ω R_c), and their number. By linearity one gradient of Σ_j CE_j / |ζ(j)| (|ζ(j)|: the size
    of row j's minibatch) instead of one per minibatch: fewer kernel launches."""
    n = len(y)
    omega = {k: p.detach() for k, p in classifier.named_parameters()}
    b = batch_size or n
    k = -(-n // b)                                                   # the number of minibatches
    w = torch.full((n,), 1 / b, device=z.device)
    w[(k - 1) * b:] = 1 / (n - (k - 1) * b)                          # the last, maybe smaller, one

    def risk(omega):
        out = torch.func.functional_call(classifier, omega, (z,))
        return (F.cross_entropy(out, y, reduction="none") * w).sum()
    g = torch.func.grad(risk)(omega)
    return torch.cat([g[name].reshape(-1) for name in omega]), k


def gbar_update(g_tilde, g_bar, v):
    """Appendix C, server: g̃^t = v g̃^{t-1} + (1 − v) g_bar_ω (v = 0.95, g̃^0 = 0, no bias
    correction, as the code); g̃^t is what the clients align to in step 3. ValueError unless g_bar
    has g̃'s shape."""
    if g_bar.shape != g_tilde.shape:
        raise ValueError(f"gbar_update: g_bar of shape {tuple(g_bar.shape)} for g̃ of shape "
                         f"{tuple(g_tilde.shape)}")
    return v * g_tilde + (1 - v) * g_bar


def iir_penalty(g, g_tilde):
    """||∇_ω R_c − g̃||² (no normalisation, as the code): g the gradients of the classifier's
    parameters in their order, g̃ flat."""
    d = torch.cat([gi.reshape(-1) for gi in g]) - g_tilde
    return torch.dot(d, d)                    # (d.pow(2).sum() takes 6 more ops a step: measured)


def iir_objective(model, params, buffers, x, y, w, g_tilde, gamma):
    """Step 3 on client c, the local objective of one minibatch ζ = (x, y) (Algorithm 1, FedIIR's
    g_c line; the (FEDIIR) objective): R_c(θ; ζ) + γ ||∇_ω R_c(θ; ζ) − g̃||², in the code's form
    (for the paper's γ/2, pass γ/2), at `params` (dicts by the model's names), R_c = Σ_j w_j CE_j
    (w_j = 1/b on a minibatch of b; 0 on the padding of the clients at once). ∇_ω R_c is a nested
    torch.func.grad kept in the graph, so that the penalty's gradient reaches both ω and φ
    (double backward). γ = 0: the plain cross-entropy (FedAvg's)."""
    part = lambda prefix: {k[len(prefix):]: v for d in (params, buffers) for k, v in d.items()
                           if k.startswith(prefix)}
    z = torch.func.functional_call(model.featurizer, part("featurizer."), (x,))

    def risk(omega):
        out = torch.func.functional_call(model.classifier, omega, (z,))
        return (F.cross_entropy(out, y, reduction="none") * w).sum()
    if gamma == 0:
        return risk(part("classifier."))
    g, r = torch.func.grad_and_value(risk)(part("classifier."))      # ∇_ω R_c(θ; ζ), in the graph
    return r + gamma * iir_penalty(g.values(), g_tilde)


def server_update(theta, delta_sum, weight_sum, global_lr=1.0):
    """Step 4, server: θ^t = θ^{t-1} + η_g Σ_c p_c Δ_c / Σ_c p_c with Δ_c = θ_c − θ^{t-1}. theta:
    θ^{t-1} as a flat vector; delta_sum: Σ_c p_c Δ_c over the sampled clients; weight_sum: Σ_c p_c
    (p_c = 1: Algorithm 1's and the code's 1/C, so C). ValueError unless the sum has θ's shape and
    the weights a positive sum."""
    if delta_sum.shape != theta.shape or not weight_sum > 0:
        raise ValueError(f"server_update: a sum of shape {tuple(delta_sum.shape)} and weights "
                         f"{weight_sum} for θ of shape {tuple(theta.shape)}")
    return theta + global_lr * (delta_sum / weight_sum)


# ------------------------------------------------------------------------- what a client runs

@common.replies(lambda site, sent: {"grad": common.get_flat(site.model.classifier), "count": 0},
                grad="sum", count="sum")           # the server needs their sums, no client's own
def classifier_gradient(site, sent):
    """Step 2 on client c: its classifier gradients at θ^{t-1} (train mode) summed over its
    minibatches of the local batch size, on the inputs its local steps train on (the code's g_bar
    pass: the photos augmented, from the client's own stream; the digits draw nothing), and their
    number."""
    model, client, b = site.model, site.client, site.args.batch_size
    # Φ(x) in chunks: with BatchNorm the code's minibatches (their statistics); else large ones
    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        b = max(b, 2 ** 21 // client.x[0].numel())                # (fewer launches)
    z = common.features(site, sent["theta"], client.x, train=True, chunk=b)   # the training inputs
    grad, count = classifier_grads(model.classifier, z, client.y, site.args.batch_size)
    return {"grad": grad, "count": count}


@common.stackable                       # with --parallel-clients on, every sampled client at once
@common.replies(lambda site, sent: {"delta": sent["theta"], "loss": common.SCALAR},
                delta="sum", loss="mean")          # the server needs Σ_c Δ_c, no client's own
def client_update(site, sent):
    """Step 3 on client c: θ_c ← θ^{t-1}, K minibatch steps on the penalised objective; Δ_c =
    θ_c − θ^{t-1} and its mean loss."""
    objective = functools.partial(iir_objective, g_tilde=sent["g_tilde"], gamma=sent["gamma"])
    theta_c, loss = common.local_train(site, sent["theta"], objective)
    return {"delta": theta_c - sent["theta"], "loss": loss}


# ------------------------------------------------------------------------------------ one round

def fediir_round(t, model, fed, args, state, ctx):
    theta = common.get_flat(model)                                     # θ^{t-1}
    S = common.sample_clients(ctx, len(fed.clients), args.sample)      # step 1
    if args.gamma > 0:                     # step 2 (+ EMA, App. C); at γ = 0: FedAvg exactly
        up = common.on_clients(classifier_gradient, S, {"theta": theta}, t, ctx)   # their sums
        g_bar = up["grad"] / up["count"]                                 # over every minibatch
        state["g_tilde"] = gbar_update(state["g_tilde"], g_bar, args.ema)
    # step 3: θ^{t-1} and g̃^t to S; each c trains on R_c + γ ||∇_ω R_c − g̃||² (no 1/2), Δ_c back
    sent = {"theta": theta, "g_tilde": state["g_tilde"], "gamma": args.gamma}
    up = common.on_clients(client_update, S, sent, t, ctx)             # Σ_c Δ_c back
    C = float(len(S))                                                  # step 4: 1/C Σ_c Δ_c
    common.set_flat(model, server_update(theta, up["delta"], C, args.global_lr))
    return {tuple(S): up["loss"]}                                      # their mean loss


def init_state(model, fed, args, ctx):
    return {"g_tilde": torch.zeros_like(common.get_flat(model.classifier))}      # g̃^0 = 0


def add_args(p):
    p.add_argument("--gamma", type=float, help="penalty weight γ (Table 3, per dataset)")
    p.add_argument("--ema", type=float, help="EMA rate v of the global gradient (Appendix C)")


def check(args, given):
    if not args.gamma >= 0:
        raise common.UserError(f"--gamma must be >= 0, got {args.gamma}")
    if not 0 <= args.ema < 1:
        raise common.UserError(f"--ema must be in [0, 1), got {args.ema}")


METHOD = common.Method("fediir", __doc__, fediir_round,
                       clients=(classifier_gradient, client_update), init_state=init_state,
                       add_args=add_args, defaults=DEFAULTS, check=check, parallel=True)


def main(argv=None):                  # the program: the command line, checkpoints, results
    if importlib.util.find_spec("harness") is None:   # copied without harness/: common.program
        return common.program(METHOD, argv)
    return importlib.import_module("harness").main(METHOD, argv)


if __name__ == "__main__":
    main()
