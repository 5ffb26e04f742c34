"""Format conversions: torch.save, safetensors and torch DCP to and from shardkit."""
