"""The train state as a pytree of arrays, initialised straight into its shardings.

A :class:`TrainState` holds the step, the trainable parameters (``nnx.Param`` state), the optimizer state
and the rest of the model's state; the model's graph definition rides along as static data so
``state.model()`` rebuilds the module inside a jitted step. Nothing here is stateful: the step function
returns a new state (big_vision's ``update_fn`` pattern) and jit donates the old one.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from histeve_jax.parallel import axes
from histeve_jax.parallel import sharding as sharding_lib
from histeve_jax.parallel.axes import Rules


@struct.dataclass
class TrainState:
    """Step counter, trainable params, optimizer state and non-trainable model state of one run."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    rest: nnx.State
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)

    def model(self, params: nnx.State | None = None) -> nnx.Module:
        """The module with these (or the given) parameters."""
        return nnx.merge(self.graphdef, self.params if params is None else params, self.rest)


def state_from_model(model: nnx.Module, tx: optax.GradientTransformation) -> TrainState:
    """A fresh TrainState (step 0, optimizer initialised) around ``model``; trace it under jit to shard it."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rest=rest, graphdef=graphdef
    )


def abstract_train_state(
    model_fn: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    rules: Rules = axes.RULES,
) -> tuple[TrainState, TrainState]:
    """(abstract state of ShapeDtypeStructs carrying shardings, the sharding tree); allocates nothing."""
    # Shardings come from our rules table at jit boundaries, not from eager per-variable sharding.
    with nnx.use_eager_sharding(False):
        abstract = jax.eval_shape(lambda: state_from_model(model_fn(), tx))
    shardings = sharding_lib.tree_shardings(abstract, mesh, rules)
    return sharding_lib.with_shardings(abstract, shardings), shardings


def create_train_state(
    model_fn: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    rules: Rules = axes.RULES,
) -> tuple[TrainState, TrainState]:
    """(initialised TrainState, its sharding tree): ``model_fn`` runs under jit with those out_shardings, so
    every parameter and moment is created already split over the mesh, never whole on one device."""
    _, shardings = abstract_train_state(model_fn, tx, mesh, rules)

    def init() -> TrainState:
        with nnx.use_eager_sharding(False):
            return state_from_model(model_fn(), tx)

    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return state, shardings


def shard_model_state(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    rules: Rules = axes.RULES,
) -> tuple[TrainState, TrainState]:
    """(TrainState, shardings) for an existing (e.g. pretrained) model; the optimizer state is built under
    jit with its shardings. A model ``load_hf`` put on ``mesh`` by the same rules is already in place."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    abstract = jax.eval_shape(lambda p, r: state_from_model(nnx.merge(graphdef, p, r), tx), params, rest)
    shardings = sharding_lib.tree_shardings(abstract, mesh, rules)
    params = jax.device_put(params, shardings.params)
    rest = jax.device_put(rest, shardings.rest)

    def init(p: nnx.State, r: nnx.State) -> TrainState:
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p), rest=r, graphdef=graphdef
        )

    state = jax.jit(init, out_shardings=shardings)(params, rest)
    return state, shardings
