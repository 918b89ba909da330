"""composer_jax: a JAX/Flax reproduction of the Composer 2.5 recipe on a Kimi-K2.5-shaped MoE.

Import the parts you need (`import composer_jax` stays light and touches no backend):

  from composer_jax import model, sharding, pipeline
"""

__version__ = "0.1.0"
