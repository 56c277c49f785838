"""The MLX engines: ``engine.MlxEngine`` (mlx-lm text models) and ``vlm_engine.MlxVlmEngine``
(mlx-vlm vision-language models), each on its runner."""

__all__ = ["engine", "runner", "vlm_engine", "vlm_load"]
