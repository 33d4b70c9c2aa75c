"""Adapters for training frameworks (``jaxpaged.integrations.tunix``)."""
