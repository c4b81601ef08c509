"""Low-level ops shared by the layers (attention implementations live here)."""
