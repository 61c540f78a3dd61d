"""Graph passes: TeSA propagation and execution-plan transformation."""
