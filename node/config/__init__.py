"""Configuration: typed, frozen settings of the model, training and peers (the lowest layer)."""
