"""`pdserve serve`'s configuration: `serve.ServeConfig` and its sections (YAML and flags),
`fields` (the field machinery: help text and checks on each field), `flags` (argparse flags
generated from the fields).
"""
