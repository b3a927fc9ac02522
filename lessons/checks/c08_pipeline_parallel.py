"""Lesson 08's checks: `stage_layers` on hand-made cases, sizes that leave a stage empty, every size up to 64 layers
and 8 stages against minivllm's pp_layer_partition, then SmolLM2-135M's stages built from your bounds."""

import os

from course import ExerciseFailed, expect_equal
from minivllm.worker.distributed import pp_layer_partition


def _partition(num_layers, pp_size):
    """minivllm's own split, without the VLLM_PP_LAYER_PARTITION override a notebook may have set."""
    saved = os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    try:
        return pp_layer_partition(num_layers, pp_size)
    finally:
        if saved is not None:
            os.environ["VLLM_PP_LAYER_PARTITION"] = saved


def _sizes(num_layers, pp_size):
    return f"{num_layers} layers, {pp_size} stage{'' if pp_size == 1 else 's'}"


def _call(fn, num_layers, pp_size, what):
    try:
        out = fn(num_layers, pp_size)
    except (NotImplementedError, ExerciseFailed):
        raise
    except Exception as exc:
        raise ExerciseFailed(f"{what} ({_sizes(num_layers, pp_size)}): raised {type(exc).__name__}: {exc}")
    try:
        return [tuple(b) for b in out]
    except TypeError:
        raise ExerciseFailed(f"{what} ({_sizes(num_layers, pp_size)}): expected a list of (start, end) "
                             f"pairs, got {out!r}") from None


def _case(fn, num_layers, pp_size, what):
    expected = _partition(num_layers, pp_size)
    actual = _call(fn, num_layers, pp_size, what)
    if actual != expected:
        counts = [e - s for s, e in actual] if all(len(b) == 2 for b in actual) else "?"
        raise ExerciseFailed(f"{what} ({_sizes(num_layers, pp_size)}): expected {expected} (layers per "
                             f"stage {[e - s for s, e in expected]}), got {actual} (layers per stage {counts})")


def _refused(fn, num_layers, pp_size, what):
    try:
        out = fn(num_layers, pp_size)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        raise ExerciseFailed(f"{what}: expected ValueError, got {type(exc).__name__}: {exc}") from None
    raise ExerciseFailed(f"{what}: expected ValueError (every stage needs at least one layer), got {out!r}")


def check_stage_layers(fn):
    _case(fn, 30, 1, "one stage holds every layer")
    _case(fn, 30, 2, "SmolLM2's 30 layers on 2 stages")
    _case(fn, 30, 3, "30 layers on 3 stages")
    yield "layers that divide: equal, contiguous stages, end exclusive"
    _case(fn, 30, 4, "30 layers on 4 stages (the earlier stages take one fewer)")
    _case(fn, 5, 3, "5 layers on 3 stages")
    _case(fn, 7, 7, "one layer per stage")
    yield "layers that do not divide: the earlier stages take one fewer"
    _refused(fn, 3, 4, "4 stages for 3 layers")
    _refused(fn, 30, 0, "0 stages")
    yield "more stages than layers, or none: ValueError"
    for num_layers in range(1, 65):
        for pp_size in range(1, min(num_layers, 8) + 1):
            _case(fn, num_layers, pp_size, "against pp_layer_partition")
    yield "every size up to 64 layers and 8 stages equals minivllm's pp_layer_partition"
    import torch
    from minivllm.model.default_model import default_model_dir
    from minivllm.model.layers import PPStage, TPGroup
    from minivllm.model.llama import LlamaForCausalLM, ModelConfig
    cfg = ModelConfig.from_dir(default_model_dir())
    for pp_size in (2, 4):
        mine = _call(fn, cfg.num_hidden_layers, pp_size, "SmolLM2-135M")
        for stage, (start, end) in enumerate(mine):
            with torch.device("meta"):
                model = LlamaForCausalLM(cfg, TPGroup(), PPStage(stage, pp_size, start, end))
            expect_equal(len(model.layers), _partition(cfg.num_hidden_layers, pp_size)[stage][1]
                         - _partition(cfg.num_hidden_layers, pp_size)[stage][0],
                         f"SmolLM2-135M on {pp_size} stages, stage {stage}: decoder layers in the model built "
                         f"from your bounds ({start}, {end})")
    yield "SmolLM2-135M's stages, built on the meta device from your bounds, hold the layers the engine's hold"
