"""The stage contract the runtime relies on, and that a stage-by-stage pipeline equals one model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.config import ConfigError, ModelConfig
from swarm.data import BYTE_PAD_ID, split_inputs_targets
from swarm.model import (
    Boundary,
    ComposedModel,
    GPTStage,
    build_stage,
    build_stages,
    load_stages,
    stage_boundary,
)
from swarm.model.spec import builds_one_stage, probe_boundary
from swarm.wire.validate import IGNORE_INDEX

TINY = {"d_model": 32, "n_heads": 2, "d_ff": 64, "seq_len": 16, "vocab_size": 257}


def tiny_cfg(**overrides: object) -> ModelConfig:
    return ModelConfig(**{**TINY, "n_layers": 4, "num_stages": 2, **overrides})


def sample(batch: int = 3, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=gen)
    tokens[0, -4:] = IGNORE_INDEX  # a padded sample tail, as the corpus produces
    return split_inputs_targets(tokens, BYTE_PAD_ID)


def pipelined_loss(
    stages: list[torch.nn.Module], inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """What the distributed runtime does: every stage starts from a leaf input, and backward hands each
    stage's input gradient to the previous stage as its grad_output."""
    if len(stages) == 1:
        loss = stages[0](inputs, targets)
        loss.backward()
        return loss
    outputs: list[torch.Tensor] = []
    leaves: list[torch.Tensor] = []
    hidden = inputs
    for stage in stages[:-1]:
        outputs.append(stage(hidden))
        hidden = outputs[-1].detach().requires_grad_()
        leaves.append(hidden)
    loss = stages[-1](hidden, targets)
    loss.backward()
    for output, leaf in reversed(list(zip(outputs, leaves, strict=True))):
        output.backward(leaf.grad)
    return loss


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("bottleneck", [0, 8])
@pytest.mark.parametrize("share_weights", [False, True])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_pipelined_stages_match_one_graph(num_stages: int, share_weights: bool, bottleneck: int) -> None:
    """Stage by stage, as the swarm runs it, the loss and every gradient are those of the whole model in
    one graph (bottleneck layers included: the boundary's down- and up-projection are learned too)."""
    stages = load_stages(tiny_cfg(n_layers=5, num_stages=num_stages, share_weights=share_weights,
                                  bottleneck=bottleneck))
    model = ComposedModel(stages)
    inputs, targets = sample()

    reference = model(inputs, targets)
    reference.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)

    loss = pipelined_loss(stages, inputs, targets)
    assert loss.item() == reference.item()
    actual = grads(model)
    assert expected.keys() == actual.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=0, atol=1e-6, msg=name)


def test_stage_contract() -> None:
    cfg = tiny_cfg(n_layers=5, num_stages=3)
    first, middle, last = build_stages(cfg)
    assert [(s.index, s.is_first, s.is_last) for s in (first, middle, last)] == [
        (0, True, False),
        (1, False, False),
        (2, False, True),
    ]
    assert [s.n_layers for s in (first, middle, last)] == [2, 2, 1]  # earlier stages take the extra layer
    inputs, targets = sample(batch=2)
    hidden = first(inputs)
    assert hidden.shape == (2, 16, 32) and hidden.dtype == torch.float32
    assert middle(hidden).shape == (2, 16, 32)
    loss = last(middle(hidden), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    with pytest.raises(ValueError, match="targets"):
        last(hidden)


def test_bottleneck_layers_narrow_every_boundary_and_start_as_a_projection() -> None:
    """With model.bottleneck = 8 only 8 values per token cross each boundary; at initialization each
    boundary's down- then up-projection is an orthogonal projection (applying it twice changes nothing),
    so the residual stream keeps its scale within the projected subspace."""
    cfg = tiny_cfg(n_layers=3, num_stages=3, bottleneck=8)
    first, middle, last = build_stages(cfg)
    assert not hasattr(first, "up") and not hasattr(last, "down")
    inputs, targets = sample(batch=2)
    hidden = first(inputs)
    assert hidden.shape == (2, 16, 8)
    assert middle(hidden).shape == (2, 16, 8)
    assert torch.isfinite(last(middle(hidden), targets))
    for before, after in ((first, middle), (middle, last)):
        projection = after.up.weight @ before.down.weight  # [d_model, d_model]
        torch.testing.assert_close(projection @ projection, projection, rtol=0, atol=1e-5)
        assert torch.linalg.matrix_rank(projection).item() == 8
    unpartitioned = build_stages(tiny_cfg(n_layers=3, num_stages=3))  # same blocks, no bottleneck
    assert first.blocks[0].attn.qkv.weight.equal(unpartitioned[0].blocks[0].attn.qkv.weight)


def test_single_stage_takes_ids_and_targets() -> None:
    (stage,) = build_stages(tiny_cfg(num_stages=1))
    assert stage.is_first and stage.is_last and stage.index == 0
    inputs, targets = sample()
    assert stage(inputs, targets).dim() == 0


def test_shared_weights_keep_one_block_per_stage() -> None:
    shared = build_stages(tiny_cfg(num_stages=2, share_weights=True))
    separate = build_stages(tiny_cfg(num_stages=2))
    assert [len(s.blocks) for s in shared] == [1, 1]
    assert [len(s.blocks) for s in separate] == [2, 2]
    assert sum(p.numel() for p in shared[1].parameters()) < sum(p.numel() for p in separate[1].parameters())


def test_build_stage_is_deterministic_whatever_the_global_rng() -> None:
    cfg = tiny_cfg(num_stages=3, n_layers=3)
    torch.manual_seed(1)
    a = build_stage(cfg, 1)
    torch.manual_seed(2)
    b = build_stage(cfg, 1)
    whole = build_stages(cfg)[1]
    for (name, pa), pb, pw in zip(a.named_parameters(), b.parameters(), whole.parameters(), strict=True):
        assert torch.equal(pa, pb) and torch.equal(pa, pw), name
    other_seed = build_stage(tiny_cfg(num_stages=3, n_layers=3, init_seed=1), 1)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, other_seed.blocks[0].attn.qkv.weight)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, build_stage(cfg, 2).blocks[0].attn.qkv.weight)


def test_build_stage_constructs_no_other_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's process holds its own stage only: no other stage's module (or parameters) is built."""
    cfg = tiny_cfg(num_stages=4, n_layers=6, bottleneck=8)
    built: list[int] = []
    construct = GPTStage.__init__

    def recording(self: GPTStage, cfg: ModelConfig, index: int, n_layers: int) -> None:
        built.append(index)
        construct(self, cfg, index, n_layers)

    monkeypatch.setattr(GPTStage, "__init__", recording)
    assert builds_one_stage(cfg)
    for k in range(cfg.num_stages):
        built.clear()
        stage = build_stage(cfg, k)
        assert built == [k]
        _, outputs = stage_boundary(cfg, stage)
        assert built == [k]  # the boundary is declared: nothing was probed
        assert (outputs is None) == (k == cfg.num_stages - 1)


@pytest.mark.parametrize("bottleneck", [0, 8])
@pytest.mark.parametrize("share_weights", [False, True])
def test_stage_built_alone_is_bit_identical_to_the_whole_list(bottleneck: int, share_weights: bool) -> None:
    """Every stage's weights are the same bits whether a process builds it alone, after other stages, or
    as part of the whole list: replicas started on different machines agree without talking."""
    cfg = tiny_cfg(num_stages=4, n_layers=6, bottleneck=bottleneck, share_weights=share_weights)
    whole = build_stages(cfg)
    after_others = [build_stage(cfg, k) for k in reversed(range(cfg.num_stages))][::-1]
    for k in range(cfg.num_stages):
        torch.manual_seed(100 + k)
        alone = build_stage(cfg, k)
        for other in (whole[k], after_others[k]):
            names = [n for n, _ in other.named_parameters()]
            assert [n for n, _ in alone.named_parameters()] == names
            assert sum(p.numel() for p in alone.parameters()) == sum(p.numel() for p in other.parameters())
            for (name, a), b in zip(alone.named_parameters(), other.parameters(), strict=True):
                assert torch.equal(a, b), (k, name)


@pytest.mark.parametrize("bottleneck", [0, 8])
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_declared_boundary_equals_probed(num_stages: int, bottleneck: int) -> None:
    cfg = tiny_cfg(num_stages=num_stages, n_layers=4, bottleneck=bottleneck)
    width = bottleneck or cfg.d_model
    for k in range(num_stages):
        stage = build_stage(cfg, k)
        declared = stage_boundary(cfg, stage)
        assert declared == probe_boundary(cfg, stage)
        assert declared[0] == (Boundary(torch.int64, (16,)) if k == 0 else Boundary(torch.float32, (16, width)))


@pytest.mark.usefixtures("example_specs")
def test_list_only_spec_falls_back_to_the_list_and_to_probing() -> None:
    """A spec without a `stage` argument still serves: its stage is taken from the whole list, and its
    boundary (undeclared) is found by running the stages before it."""
    cfg = tiny_cfg(spec="spec_example:tiny_spec", num_stages=3)
    assert not builds_one_stage(cfg)
    middle = build_stage(cfg, 1)
    assert isinstance(middle, torch.nn.Module) and middle.index == 1 and not middle.is_last
    for a, b in zip(middle.parameters(), load_stages(cfg)[1].parameters(), strict=True):
        assert torch.equal(a, b)
    assert stage_boundary(cfg, middle) == (Boundary(torch.float32, (16, 32)), Boundary(torch.float32, (16, 32)))
    assert stage_boundary(cfg, build_stage(cfg, 0))[0] == Boundary(torch.int64, (16,))
    assert stage_boundary(cfg, build_stage(cfg, 2))[1] is None


@pytest.mark.usefixtures("example_specs")
def test_user_spec_with_stage_argument_builds_single_stages() -> None:
    """A user spec taking `stage` is asked for one stage at a time, also when its undeclared boundary is
    probed (the stages before it, one by one), and never for the whole list."""
    import spec_example

    cfg = tiny_cfg(spec="spec_example:per_stage", num_stages=3)
    spec_example.BUILT.clear()
    last = build_stage(cfg, 2)
    assert last.is_last and spec_example.BUILT == [2]
    assert stage_boundary(cfg, last) == (Boundary(torch.float32, (16, 32)), None)
    assert spec_example.BUILT == [2, 0, 1]
    for a, b in zip(last.parameters(), load_stages(cfg)[2].parameters(), strict=True):
        assert torch.equal(a, b)


def test_residual_projections_are_scaled_down() -> None:
    (stage,) = build_stages(tiny_cfg(num_stages=1, n_layers=8))
    block = stage.blocks[0]
    assert block.attn.proj.weight.std() < 0.5 * block.attn.qkv.weight.std()
    assert block.mlp.proj.weight.std() < 0.5 * block.mlp.fc.weight.std()


def test_build_stage_rejects_out_of_range_index() -> None:
    with pytest.raises(ConfigError, match="server.stage"):
        build_stage(tiny_cfg(num_stages=2), 2)


@pytest.fixture
def example_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.mark.parametrize(
    "spec",
    [
        ":build_stages",  # no module
        "swarm.model.gpt:",  # no function
        "swarm.model.gpt:build:stages",  # two colons
        "no_such_module_for_swarm:build",
        "swarm.model.gpt:no_such_function",
        "spec_example:NOT_CALLABLE",
        "spec_example:not_a_list",
        "spec_example:too_few",
        "spec_example:not_modules",
        "spec_example:wrong_roles",
    ],
)
@pytest.mark.usefixtures("example_specs")
def test_bad_spec_raises_config_error_naming_model_spec(spec: str) -> None:
    with pytest.raises(ConfigError, match="model.spec"):
        load_stages(tiny_cfg(spec=spec, num_stages=3))


@pytest.mark.usefixtures("example_specs")
def test_user_spec_end_to_end() -> None:
    cfg = tiny_cfg(spec="spec_example:tiny_spec", num_stages=3)
    stages = load_stages(cfg)
    assert [(s.index, s.is_first, s.is_last) for s in stages] == [
        (0, True, False),
        (1, False, False),
        (2, False, True),
    ]
    inputs, targets = sample()
    model = ComposedModel(stages)
    reference = model(inputs, targets)
    reference.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    assert pipelined_loss(stages, inputs, targets).item() == reference.item()
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-6, msg=name)
    hosted = build_stage(cfg, 2)
    assert hosted.is_last and all(
        torch.equal(a, b) for a, b in zip(hosted.parameters(), stages[2].parameters(), strict=True)
    )
