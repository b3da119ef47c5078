"""Mesh construction from config: axis sizes, -1, multi-slice (DCN x ICI) layouts, axis types."""

import dataclasses

import jax
import numpy as np
import pytest

from histeve_jax.parallel import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Enough of a jax Device for mesh_utils: two slices of four CPU-like chips."""

    id: int
    slice_index: int
    process_index: int = 0
    platform: str = "cpu"
    device_kind: str = "fake"


def test_minus_one_takes_the_remaining_devices():
    assert mesh_lib.resolve_axis_sizes({"data": 2, "fsdp": -1}, 64) == (2, 32, 1)
    assert mesh_lib.resolve_axis_sizes({"tensor": 4}, 4) == (1, 1, 4)
    assert mesh_lib.resolve_axis_sizes({}, 1) == (1, 1, 1)


@pytest.mark.parametrize(
    "sizes, match",
    [
        ({"data": -1, "fsdp": -1}, "at most one axis"),
        ({"data": 3, "fsdp": -1}, "do not divide"),
        ({"data": 2, "fsdp": 2}, "need 4 devices, have 8"),
        ({"model": 2}, "unknown mesh axes"),
        ({"data": 0}, "positive or -1"),
    ],
)
def test_bad_axis_sizes_raise(sizes, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.resolve_axis_sizes(sizes, 8)


def test_multi_slice_grid_puts_slices_on_the_dcn_axis():
    devices = [FakeDevice(id=i, slice_index=i // 4) for i in range(8)]
    grid = mesh_lib.device_grid({"fsdp": -1}, {"data": 2}, devices)
    assert grid.shape == (2, 4, 1)
    slices = np.vectorize(lambda d: d.slice_index)(grid)
    # Each data index is one slice: only the data-parallel gradient all-reduce crosses DCN.
    np.testing.assert_array_equal(slices[:, :, 0], [[0, 0, 0, 0], [1, 1, 1, 1]])


def test_multi_slice_with_fsdp_across_slices():
    devices = [FakeDevice(id=i, slice_index=i // 4) for i in range(8)]
    grid = mesh_lib.device_grid({"fsdp": 2, "tensor": 2}, {"fsdp": 2}, devices)
    assert grid.shape == (1, 4, 2)
    slices = np.vectorize(lambda d: d.slice_index)(grid)
    np.testing.assert_array_equal(slices[0], [[0, 0], [0, 0], [1, 1], [1, 1]])


def test_dcn_sizes_must_match_the_slices():
    devices = [FakeDevice(id=i, slice_index=i // 4) for i in range(8)]
    with pytest.raises(ValueError, match="no -1 across slices"):
        mesh_lib.device_grid({"fsdp": -1}, {"data": -1}, devices)
    with pytest.raises(ValueError, match="Number of slices 2"):
        mesh_lib.device_grid({"fsdp": -1}, {"data": 4}, devices)


def test_mesh_axes_are_auto():
    mesh = mesh_lib.mesh_from_config({"ici": {"fsdp": -1}}, devices=jax.devices()[:1])
    assert mesh.axis_names == mesh_lib.AXES
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_mesh_flag_parses_named_and_positional_sizes():
    assert mesh_lib.parse_mesh_flag("data=2,fsdp=-1") == {"data": 2, "fsdp": -1}
    assert mesh_lib.parse_mesh_flag("1,64") == {"data": 1, "fsdp": 64}
    assert mesh_lib.parse_mesh_flag("") == {}
    with pytest.raises(ValueError, match="mix"):
        mesh_lib.parse_mesh_flag("data=2,4")
