"""On-device token sampling."""
