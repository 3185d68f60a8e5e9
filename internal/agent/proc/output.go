package proc

// Stream names one output stream of a process.
type Stream int

const (
	Stdout Stream = 1
	Stderr Stream = 2
)

// Chunk is a piece of retained output, in the order the agent read it.
type Chunk struct {
	Stream Stream
	Data   []byte
}
