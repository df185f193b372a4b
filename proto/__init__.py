"""pdserve protocol buffers: `proto/pdserve/v1/pdserve.proto` and its generated stubs."""
