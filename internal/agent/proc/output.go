package proc

// Stream names one output stream of a process.
type Stream int

const (
	Stdout Stream = 1
	Stderr Stream = 2
)

// Chunk is a piece of output, in the order the agent read it; or, with
// Dropped set and no Data, a gap: Dropped bytes of Stream that the reader of
// the chunks does not get (they were read, counted and dropped).
type Chunk struct {
	Stream  Stream
	Data    []byte
	Dropped int64
}

// liveWindow is how far a follower may fall behind on output that is not
// retained before the agent stops reading the command's pipes: the command
// then blocks in write, as it would writing into a pipe nobody drains.
const liveWindow = 1 << 20
