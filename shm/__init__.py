"""The wire contract between the processes: SPSC rings with ZeroMQ doorbells, record kinds
and the constants both ends agree on (records), message Structs, segment lifecycle."""
