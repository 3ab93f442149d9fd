"""The RPC edge: servicers, wire mapping, access control and the listeners."""
