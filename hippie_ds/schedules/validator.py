def validate(compiled):
    return compiled
