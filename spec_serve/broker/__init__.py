"""The broker: routes requests from clients to workers; its HTTP shim."""
