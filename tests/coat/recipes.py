"""recipe_of(**fields): a resolved CoatRecipe with COAT's own choices (current scaling, BF16 head) unless given."""
from megacoat.coat.recipe import CoatRecipe


def recipe_of(**fields) -> CoatRecipe:
    return CoatRecipe(**{"grad_scaling": "current", "activation_scaling": "current", "output_layer": False, **fields})
