"""Small pure helpers shared by several roles: typed option values, YAML with JSON Schema,
output-file checks, short labels.
"""
