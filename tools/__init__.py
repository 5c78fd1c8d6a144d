"""Tools the model can call, with pydantic argument schemas."""

__all__: list[str] = []
