"""A stage's gradients: where they live (the store), their all-reduce stream and buffer, tied modules' sums, and the
split backward."""
