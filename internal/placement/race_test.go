//go:build race

package placement

// raceDetector says the tests run under the race detector, which slows the
// single-goroutine simulation some twentyfold and can find nothing in it.
const raceDetector = true
