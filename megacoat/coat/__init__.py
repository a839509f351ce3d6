"""COAT: FP8 training (the recipe, the FP8 linear, the precision flow, the FP8 head and CoatAdamW)."""
from megacoat.coat.adamw import CoatAdamW
from megacoat.coat.convert import after_optimizer_step, convert_to_coat
from megacoat.coat.recipe import RECIPES, CoatRecipe

__all__ = ["RECIPES", "CoatAdamW", "CoatRecipe", "after_optimizer_step", "convert_to_coat"]
