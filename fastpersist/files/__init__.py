"""Single files where torch.save and safetensors users already are: torch
.pt/.bin files, one safetensors file, and file objects (dispatch.py chooses).
A checkpoint directory is the rest of the package's; these are for
interchange, not speed."""
