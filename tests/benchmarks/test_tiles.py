"""The ops' public tile accessors the kernel benchmarks sweep with: tiles() reports what set_tile() set, per kernel."""
import pytest

from megacoat.ops import cast_transpose, cross_entropy_fp8, label_corrections, rmsnorm, swiglu


@pytest.mark.parametrize("module", [cast_transpose, cross_entropy_fp8, label_corrections, rmsnorm, swiglu])
def test_set_tile_is_what_tiles_reports_and_restores(module):
    library = module.tiles()
    for kernel, tile in library.items():
        other = tuple(2 * v for v in tile)
        module.set_tile(kernel, other)
        try:
            assert module.tiles() == {**library, kernel: other}
        finally:
            module.set_tile(kernel, tile)
    assert module.tiles() == library
    with pytest.raises((KeyError, ValueError)):
        module.set_tile("no-such-kernel", (1,))


def test_a_tile_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError):
        cast_transpose.set_tile("cast", (32, 32))
    assert cast_transpose.tiles()["cast"] == (64, 64, 4)
