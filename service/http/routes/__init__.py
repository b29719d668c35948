"""HTTP routes of the /v1 wire, one module per resource: inference, model, health."""
