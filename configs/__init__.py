"""Named configs. Each defines get_config(arg=None) -> ConfigDict; see configs/base.py."""
