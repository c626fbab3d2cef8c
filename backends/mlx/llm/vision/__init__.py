"""Image input for vision-language programs: loading images safely, and the checkpoint processors ' preprocessing."""
