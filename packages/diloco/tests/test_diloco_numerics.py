"""DiLoCo numerics: the outer step against hand-computed Nesterov, averaging, and plain training.

Workers run as threads over in-memory LocalTransports (openprime.core.testing), so these tests check
the arithmetic of the real DiLoCo class, all-reduce included, in a fraction of a second.
"""

import attrs
import pytest
import torch

from openprime.core.codec import Codec, Float32Codec
from openprime.core.collectives import TAG_ALL_GATHER_SIZE
from openprime.core.errors import PeerFailure, ReplicaDivergence
from openprime.core.membership import StaticMembership
from openprime.core.testing import ForwardingTransport, local_group, run_threads
from openprime.core.timeouts import Timeouts
from openprime.diloco import (
    DiLoCo,
    DiLoCoConfig,
    OuterLrSchedule,
    OuterOptimizer,
    PseudoGradientDevice,
    outer_update_,
)

TIMEOUTS = Timeouts(op_s=10.0)


def _workers(k: int, theta0: torch.Tensor, config: DiLoCoConfig) -> tuple[list[torch.nn.Parameter], list[DiLoCo]]:
    params = [torch.nn.Parameter(theta0.clone()) for _ in range(k)]
    transports = local_group(k)
    dilocos = [DiLoCo([p], config=config, transport=t, timeouts=TIMEOUTS)
               for p, t in zip(params, transports, strict=True)]
    return params, dilocos


def _outer_step(params, dilocos, local_weights):
    """Pretend each worker trained to `local_weights[i]`, then run the outer step on all of them."""
    with torch.no_grad():
        for p, w in zip(params, local_weights, strict=True):
            p.copy_(w)
    return run_threads([d.sync for d in dilocos])


def test_nesterov_step_matches_hand_formula():
    theta0 = torch.tensor([1.0, -2.0, 0.5, 4.0])
    deltas = [torch.tensor([0.1, 0.2, -0.3, 0.0]), torch.tensor([0.3, -0.2, 0.1, 1.0]),
              torch.tensor([-0.1, 0.6, 0.5, 2.0])]
    params, dilocos = _workers(3, theta0, DiLoCoConfig(num_inner_steps=1))  # lr 0.7, momentum 0.9
    results = _outer_step(params, dilocos, [theta0 - d for d in deltas])

    # By hand: mean delta = (0.1, 0.2, 0.1, 1.0); m1 = delta; step = delta + 0.9 * m1 = 1.9 * delta;
    # theta1 = theta0 - 0.7 * 1.9 * delta.
    mean = torch.tensor([0.1, 0.2, 0.1, 1.0])
    theta1 = theta0 - 0.7 * 1.9 * mean
    for p, d in zip(params, dilocos, strict=True):
        torch.testing.assert_close(p.detach(), theta1, rtol=0, atol=1e-6)
        torch.testing.assert_close(d.state.momentum, mean, rtol=0, atol=1e-7)
    assert [r.num_contributors for r in results] == [3, 3, 3]
    assert len({r.state_hash for r in results}) == 1

    # Second step with every worker moving by the same delta2: m2 = 0.9*m1 + delta2, step = delta2 + 0.9*m2.
    delta2 = torch.tensor([1.0, 0.0, -1.0, 0.5])
    _outer_step(params, dilocos, [theta1 - delta2] * 3)
    m2 = 0.9 * mean + delta2
    theta2 = theta1 - 0.7 * (delta2 + 0.9 * m2)
    for p in params:
        torch.testing.assert_close(p.detach(), theta2, rtol=0, atol=1e-6)


def test_lr_one_without_momentum_averages_the_workers():
    torch.manual_seed(0)
    theta0 = torch.randn(1000)
    config = DiLoCoConfig(num_inner_steps=1, outer_lr=1.0, outer_optimizer=OuterOptimizer.SGD)
    params, dilocos = _workers(4, theta0, config)
    local = [theta0 + torch.randn(1000) for _ in range(4)]
    _outer_step(params, dilocos, local)
    for p in params:
        torch.testing.assert_close(p.detach(), torch.stack(local).mean(0), rtol=0, atol=1e-5)


def _train(model, opt, data, diloco=None):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if diloco is not None:
            diloco.step()


def test_one_worker_with_lr_one_and_no_momentum_is_plain_training():
    torch.manual_seed(1)
    data = [(torch.randn(8, 5), torch.randn(8, 3)) for _ in range(12)]
    plain = torch.nn.Linear(5, 3)
    wrapped = torch.nn.Linear(5, 3)
    wrapped.load_state_dict(plain.state_dict())
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_wrapped = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    config = DiLoCoConfig(num_inner_steps=4, outer_lr=1.0, outer_optimizer=OuterOptimizer.SGD)
    (transport,) = local_group(1)
    diloco = DiLoCo(wrapped.parameters(), config=config, transport=transport, timeouts=TIMEOUTS)
    _train(plain, opt_plain, data)
    _train(wrapped, opt_wrapped, data, diloco)
    assert diloco.num_outer_steps_done == 3
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.equal(plain.weight, torch.nn.Linear(5, 3).weight)  # it did train


def test_step_counts_inner_steps():
    (transport,) = local_group(1)
    p = torch.nn.Parameter(torch.zeros(3))
    diloco = DiLoCo([p], config=DiLoCoConfig(num_inner_steps=3), transport=transport, timeouts=TIMEOUTS)
    outcomes = [diloco.step() for _ in range(7)]
    assert [o is not None for o in outcomes] == [False, False, True, False, False, True, False]
    assert outcomes[5].outer_step == 2


def test_state_dict_round_trip_continues_identically():
    theta0 = torch.randn(6, generator=torch.Generator().manual_seed(3))
    params, dilocos = _workers(2, theta0, DiLoCoConfig(num_inner_steps=2))
    _outer_step(params, dilocos, [theta0 + 0.5, theta0 - 0.25])
    saved = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.state_dict().items()} for d in dilocos]
    assert saved[0]["num_outer_steps_done"] == 1 and torch.count_nonzero(saved[0]["momentum"]) > 0
    # A second pair of replicas, built from scratch, loads the state and must take the same next step.
    params2, resumed = _workers(2, torch.zeros(6), DiLoCoConfig(num_inner_steps=2))
    for d, state in zip(resumed, saved, strict=True):
        d.load_state_dict(state)
    assert torch.equal(params2[0].detach(), params[0].detach())
    nxt = [theta0 + 1.0, theta0 - 2.0]
    a, b = _outer_step(params, dilocos, nxt), _outer_step(params2, resumed, nxt)
    assert a[0].state_hash == b[0].state_hash and a[0].outer_step == b[0].outer_step == 2
    with pytest.raises(ValueError, match="it was saved from another model"):
        _workers(1, torch.zeros(5), DiLoCoConfig())[1][0].load_state_dict(saved[0])


def test_mean_divides_by_contributors_only():
    theta0 = torch.zeros(4)
    params, dilocos = _workers(3, theta0, DiLoCoConfig(num_inner_steps=1, outer_lr=1.0,
                                                       outer_optimizer=OuterOptimizer.SGD))
    with torch.no_grad():
        params[0].copy_(torch.full((4,), 3.0))
        params[1].copy_(torch.full((4,), 5.0))
        params[2].copy_(torch.full((4,), 100.0))  # a joiner whose weights must not count
    results = run_threads([lambda: dilocos[0].sync(), lambda: dilocos[1].sync(),
                           lambda: dilocos[2].sync(contribute=False)])
    assert [r.num_contributors for r in results] == [2, 2, 2]
    for p in params:
        torch.testing.assert_close(p.detach(), torch.full((4,), 4.0))


@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_replica_whose_training_blew_up_contributes_nothing(codec, bad):
    """A replica with NaN/inf weights (its inner training diverged) is left out of the mean: the global weights
    stay finite, and it comes back to the others' average. Before, the NaN reached every replica's weights in
    fp32, and the int8 quantizer stopped the node with an error."""
    from openprime.kernels import Int8Codec

    theta0 = torch.zeros(4096)
    params = [torch.nn.Parameter(theta0.clone()) for _ in range(3)]
    config = DiLoCoConfig(num_inner_steps=1, outer_lr=1.0, outer_optimizer=OuterOptimizer.SGD)
    codecs = [Int8Codec() if codec == "int8" else Float32Codec() for _ in range(3)]
    dilocos = [DiLoCo([p], config=config, transport=t, timeouts=TIMEOUTS, codec=c)
               for p, t, c in zip(params, local_group(3), codecs, strict=True)]
    good = torch.linspace(-1.0, 1.0, 4096)
    blown = good.clone()
    blown[17] = bad
    results = _outer_step(params, dilocos, [good, blown, good])
    assert [r.num_contributors for r in results] == [2, 2, 2]
    assert [r.contributed for r in results] == [True, False, True]
    assert len({r.state_hash for r in results}) == 1
    for p in params:  # the mean of the two good replicas (exact in fp32; within int8's error otherwise)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.detach(), good, rtol=0, atol=0 if codec == "fp32" else 0.02)
        assert torch.equal(p.detach(), params[0].detach())


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_finite_pseudo_gradients_whose_sum_would_overflow_stay_out(codec):
    """Finite values past fp32's maximum / members (3e38 in two of three replicas: their sum is past fp32's
    range) stay out of the mean, as NaN does; values at that bound (1.1e38 <= 3.4e38 / 3) still count, and their
    sum is exact. Before, fp32 summed them to inf in every replica's weights, and the int8 encoder of the hop
    where the sum overflowed raised (that node's thread died, the others timed out)."""
    from openprime.kernels import Int8Codec

    def run(bad_value: float) -> tuple[list, list[torch.nn.Parameter]]:
        params = [torch.nn.Parameter(torch.zeros(4096)) for _ in range(3)]
        config = DiLoCoConfig(num_inner_steps=1, outer_lr=1.0, outer_optimizer=OuterOptimizer.SGD)
        codecs = [Int8Codec() if codec == "int8" else Float32Codec() for _ in range(3)]
        dilocos = [DiLoCo([p], config=config, transport=t, timeouts=TIMEOUTS, codec=c)
                   for p, t, c in zip(params, local_group(3), codecs, strict=True)]
        blown = good.clone()
        blown[17] = -bad_value  # the pseudo-gradient is theta - weights: +bad_value there
        return _outer_step(params, dilocos, [good, blown, blown]), params

    good = torch.linspace(-1.0, 1.0, 4096)
    results, params = run(3e38)
    assert [r.num_contributors for r in results] == [1, 1, 1]
    assert [r.contributed for r in results] == [True, False, False]
    for p in params:  # the one good replica's weights, exactly (int8 within its error)
        torch.testing.assert_close(p.detach(), good, rtol=0, atol=0 if codec == "fp32" else 0.02)
        assert torch.equal(p.detach(), params[0].detach())
    results, params = run(1.1e38)
    assert [r.num_contributors for r in results] == [3, 3, 3]
    for p in params:
        assert torch.isfinite(p).all() and torch.equal(p.detach(), params[0].detach())
        # theta = -(mean pseudo-gradient) = -(2 x 1.1e38 + small) / 3 at element 17
        assert float(p.detach()[17]) == pytest.approx(-2.2e38 / 3, rel=1e-3)


def test_a_replica_that_withholds_its_pseudo_gradient_takes_the_others_average():
    """`step(contribute=False)`: the loop says its replica is unhealthy (its last inner steps had no finite
    gradient), so even finite weights stay out of the mean; with nobody contributing, theta is unchanged."""
    theta0 = torch.zeros(4)
    params, dilocos = _workers(2, theta0, DiLoCoConfig(num_inner_steps=1, outer_lr=1.0,
                                                       outer_optimizer=OuterOptimizer.SGD))
    with torch.no_grad():
        params[0].copy_(torch.full((4,), 2.0))
        params[1].copy_(torch.full((4,), 1e30))  # finite, but garbage
    results = run_threads([lambda: dilocos[0].step(), lambda: dilocos[1].step(contribute=False)])
    assert [(r.num_contributors, r.contributed) for r in results] == [(1, True), (1, False)]
    for p in params:
        assert torch.equal(p.detach(), torch.full((4,), 2.0))
    before = dilocos[0].state.theta.clone()
    results = run_threads([lambda: dilocos[0].step(contribute=False), lambda: dilocos[1].step(contribute=False)])
    assert [r.num_contributors for r in results] == [0, 0] and not results[0].skipped
    for p, d in zip(params, dilocos, strict=True):
        assert torch.equal(d.state.theta, before) and torch.equal(p.detach(), before)


def test_divergent_replicas_are_detected():
    params, dilocos = _workers(2, torch.zeros(3), DiLoCoConfig(num_inner_steps=1))
    dilocos[1].state.momentum[0] = 1e-3  # corrupt one replica's outer state
    with pytest.raises(ReplicaDivergence, match="differs across replicas"):
        run_threads([d.sync for d in dilocos])


class _LosesPeerAfterCommit(StaticMembership):
    """A static group whose transport fails in the hash comparison that follows the commit (a peer that left after
    applying); it records whether DiLoCo abandoned the transport."""

    def __init__(self, transport) -> None:
        super().__init__(transport)
        self.abandoned = False

    def begin(self, step, attempt, *, state_hash, hash_step):
        rnd = super().begin(step, attempt, state_hash=state_hash, hash_step=hash_step)
        return attrs.evolve(rnd, transport=_FailsSecondGather(self.transport))

    def abandon(self) -> None:
        self.abandoned = True


class _FailsSecondGather(ForwardingTransport):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.gathers = 0

    def isend(self, peer, tag, buffers, *, deadline):
        if tag == TAG_ALL_GATHER_SIZE:
            self.gathers += 1
            if self.gathers == 2:  # the first is the contributors' flags in the try, the second the hashes
                raise PeerFailure(peer, "the peer left after applying")
        return super().isend(peer, tag, buffers, deadline=deadline)


def test_a_hash_comparison_that_fails_after_the_commit_abandons_the_transport():
    """Members waiting on this one in the comparison fail at once when it closes its transport (each transport's
    conformance suite checks that), instead of at their deadline; the step stays applied."""
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    memberships = [_LosesPeerAfterCommit(t) for t in local_group(2)]
    dilocos = [DiLoCo([p], config=DiLoCoConfig(num_inner_steps=1, outer_lr=1.0, outer_momentum=0.0), membership=m,
                      timeouts=Timeouts(op_s=0.5)) for p, m in zip(params, memberships, strict=True)]
    with torch.no_grad():
        params[0].fill_(-1.0)
        params[1].fill_(-3.0)
    results = run_threads([d.sync for d in dilocos])
    assert [m.abandoned for m in memberships] == [True, True]  # rank 1's send failed, rank 0's receive timed out
    assert [r.num_contributors for r in results] == [2, 2] and not any(r.skipped for r in results)
    assert all(torch.allclose(p.detach(), torch.full((3,), -2.0)) for p in params)  # applied: the mean


def test_outer_update_variants():
    theta, m, delta = torch.ones(2), torch.zeros(2), torch.tensor([1.0, 2.0])
    outer_update_(theta, m, delta, lr=0.5, mu=0.9, optimizer=OuterOptimizer.MOMENTUM)
    torch.testing.assert_close(theta, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(m, delta)
    outer_update_(theta, m, delta, lr=0.5, mu=0.9, optimizer=OuterOptimizer.SGD)
    torch.testing.assert_close(theta, torch.tensor([0.0, -1.0]))
    torch.testing.assert_close(m, delta)  # SGD leaves momentum alone


def test_bad_config_names_the_field():
    from openprime.core.errors import ConfigError

    with pytest.raises(ConfigError, match="num_inner_steps must be >= 1"):
        DiLoCoConfig(num_inner_steps=0)
    with pytest.raises(ConfigError, match="outer_lr must be > 0"):
        DiLoCoConfig(outer_lr=-0.7)


def test_follow_inner_scales_the_outer_lr_by_the_inner_schedule():
    """outer_lr_schedule=follow_inner: the outer step of a constant-lr run at outer_lr x the inner schedule's factor."""
    theta0 = torch.tensor([1.0, -2.0, 0.5, 4.0])
    deltas = [torch.tensor([0.1, 0.2, -0.3, 0.0]), torch.tensor([0.3, -0.2, 0.1, 1.0])]
    factor = [0.5]
    config = DiLoCoConfig(num_inner_steps=1, outer_lr_schedule=OuterLrSchedule.FOLLOW_INNER)
    params = [torch.nn.Parameter(theta0.clone()) for _ in range(2)]
    dilocos = [DiLoCo([p], config=config, transport=t, timeouts=TIMEOUTS, lr_factor=lambda _: factor[0])
               for p, t in zip(params, local_group(2), strict=True)]
    reference_params, references = _workers(2, theta0, DiLoCoConfig(num_inner_steps=1, outer_lr=0.7 * 0.5))
    for ps, ds in ((params, dilocos), (reference_params, references)):
        _outer_step(ps, ds, [theta0 - d for d in deltas])
    assert dilocos[0].outer_lr == pytest.approx(0.35)
    for p, q in zip(params, reference_params, strict=True):
        assert torch.equal(p.detach(), q.detach())
    factor[0] = 0.0  # the end of a cooldown: the momentum no longer moves the weights
    before = params[0].detach().clone()
    _outer_step(params, dilocos, [before, before])
    assert torch.equal(params[0].detach(), before)
    with pytest.raises(ValueError, match="lr_factor"):
        DiLoCo([torch.nn.Parameter(theta0.clone())], config=config, transport=local_group(1)[0], timeouts=TIMEOUTS)


def test_follow_inner_applies_the_last_outer_step_at_the_lr_of_the_inner_steps_that_fed_it():
    """The factor was taken at the outer step's inner-step count, the step after the ones that fed it: at the run's
    end, where the inner schedule is over (factor 0), the last outer step moved nothing and every replica went back
    to the weights before it (review of 2026-12-07). With a constant inner schedule follow_inner is constant."""
    num_steps, h = 4, 2
    theta0 = torch.tensor([1.0, -2.0, 0.5, 4.0])

    def constant_then_over(step: int) -> float:  # a LambdaLR's factor of a constant schedule of num_steps steps
        return 1.0 if step < num_steps else 0.0

    runs = {}
    for schedule in (OuterLrSchedule.CONSTANT, OuterLrSchedule.FOLLOW_INNER):
        config = DiLoCoConfig(num_inner_steps=h, outer_lr_schedule=schedule)
        param = torch.nn.Parameter(theta0.clone())
        diloco = DiLoCo([param], config=config, transport=local_group(1)[0], timeouts=TIMEOUTS,
                        lr_factor=constant_then_over)
        for step in range(num_steps):
            with torch.no_grad():
                param.sub_(0.25 * (step + 1))  # an inner step
            diloco.step()
        runs[schedule] = (diloco.outer_lr, param.detach().clone())
    assert runs[OuterLrSchedule.FOLLOW_INNER][0] == 0.7
    assert torch.equal(runs[OuterLrSchedule.FOLLOW_INNER][1], runs[OuterLrSchedule.CONSTANT][1])


def test_pseudo_gradient_on_the_parameters_device_gives_the_host_paths_bits():
    """pseudo_gradient_device=params: delta computed in its own buffer on the parameters' device (here the
    CPU, so no device transfer is exercised; a GPU run is in tools/device_check.sh), summed there, and
    copied to the host for the outer step: the same bits as the host path, a non-contributor included."""
    torch.manual_seed(3)
    theta0 = torch.randn(1001)
    steps = [[theta0 + torch.randn(1001) for _ in range(3)] for _ in range(2)]
    finals = {}
    for where in (PseudoGradientDevice.HOST, PseudoGradientDevice.PARAMS):
        params, dilocos = _workers(3, theta0, DiLoCoConfig(num_inner_steps=1, pseudo_gradient_device=where))
        assert (dilocos[0]._delta_device is None) == (where is PseudoGradientDevice.HOST)
        for local in steps:
            with torch.no_grad():
                for p, w in zip(params, local, strict=True):
                    p.copy_(w)
            run_threads([dilocos[0].sync, dilocos[1].sync, lambda d=dilocos[2]: d.sync(contribute=False)])
        finals[where] = (params[0].detach().clone(), dilocos[0].state.momentum.clone())
    host, device = finals[PseudoGradientDevice.HOST], finals[PseudoGradientDevice.PARAMS]
    assert torch.equal(host[0], device[0]) and torch.equal(host[1], device[1])
    assert not torch.equal(host[0], theta0)


class _Int8Like(Codec):
    """Stands for openprime.kernels' Int8Codec: the auto rule asks only whether a codec is fp32."""

    name = "int8"

    def payload_like(self, numel):
        raise NotImplementedError

    encode = decode_add_ = decode_ = payload_like


@pytest.mark.parametrize(("where", "codec", "device", "expected"), [
    (PseudoGradientDevice.AUTO, _Int8Like, "cpu", None),
    (PseudoGradientDevice.AUTO, _Int8Like, "cuda", "cuda"),
    (PseudoGradientDevice.AUTO, Float32Codec, "cuda", None),  # fp32: the host path sends the same bytes
    (PseudoGradientDevice.HOST, _Int8Like, "cuda", None),
    (PseudoGradientDevice.PARAMS, Float32Codec, "cuda", "cuda"),
    (PseudoGradientDevice.PARAMS, Float32Codec, "cpu", "cpu"),
])
def test_where_the_pseudo_gradient_is_computed(where, codec, device, expected):
    from openprime.diloco.diloco import _delta_device

    got = _delta_device(where, torch.device(device), codec())
    assert (got.type if got is not None else None) == expected


class _RecordsIdle(StaticMembership):
    """Records the transport's counters when DiLoCo says it is done with the round's transport."""

    def __init__(self, transport) -> None:
        super().__init__(transport)
        self.at_idle: list[tuple[int, int]] = []

    def idle(self) -> None:
        self.at_idle.append((self.transport.bytes_sent, self.transport.bytes_received))


def test_the_membership_is_told_the_transport_is_idle_only_after_the_outer_step_s_counted_traffic():
    """The mesh measures its links (bandwidth probe) once told the transport is idle; a probe that started at the
    commit ran beside the hashes' comparison, whose bytes the outer step counts, and was counted again in the next
    round (found 2026-12-07). Every byte the result counts has moved by then, and nothing after it."""
    memberships = [_RecordsIdle(t) for t in local_group(2)]
    dilocos = [DiLoCo([torch.nn.Parameter(torch.zeros(1000))], config=DiLoCoConfig(num_inner_steps=1), membership=m,
                      timeouts=TIMEOUTS) for m in memberships]
    for _ in range(2):
        before = [(m.transport.bytes_sent, m.transport.bytes_received) for m in memberships]
        results = run_threads([d.sync for d in dilocos])
        for m, (sent0, received0), r in zip(memberships, before, results, strict=True):
            assert m.at_idle[-1] == (sent0 + r.bytes_sent, received0 + r.bytes_received)
            assert m.at_idle[-1] == (m.transport.bytes_sent, m.transport.bytes_received)
    assert [len(m.at_idle) for m in memberships] == [2, 2]  # once an outer step


def test_an_outer_steps_result_counts_every_byte_its_transport_moved_and_the_wait_for_a_background_send():
    # The hashes' comparison after the commit moves bytes too: they were left out of bytes_sent/received
    # (2026-12-07), and the wait for a non-blocking donor's background send was left out of total_s.
    transports = local_group(2)
    dilocos = [DiLoCo([torch.nn.Parameter(torch.zeros(1000))], config=DiLoCoConfig(num_inner_steps=1), transport=t,
                      timeouts=TIMEOUTS) for t in transports]
    before = [(t.bytes_sent, t.bytes_received) for t in transports]
    results = run_threads([d.sync for d in dilocos])
    for t, (sent0, received0), r in zip(transports, before, results, strict=True):
        assert (r.bytes_sent, r.bytes_received) == (t.bytes_sent - sent0, t.bytes_received - received0)
        assert r.bytes_sent > 1000 // 2 * 4  # the ring's 2(n-1)/n of 1000 fp32 values, and more
    (alone,) = _workers(1, torch.zeros(8), DiLoCoConfig(num_inner_steps=1))[1]

    def background_send_ends_later():
        import time
        time.sleep(0.3)
        return 0

    alone.recovery.finish_background = background_send_ends_later
    assert alone.sync().total_s >= 0.3
