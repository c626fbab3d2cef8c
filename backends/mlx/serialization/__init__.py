"""Blob format: schema, generated bindings and the serializer."""
