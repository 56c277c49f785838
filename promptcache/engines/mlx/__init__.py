"""The MLX engines: mlx-lm text models and mlx-vlm vision-language models."""
