"""The model: the Llama-family decoder, its layers, attention, RoPE, weight loading and the model's config."""
