// ChunkLender (issue 42): staging memory that a flushed chunk can leave staging in, instead of
// being copied out of it. gpu::StagingPool implements it; store/ (the flush pipeline and the
// retained tier) uses it, so neither layer includes the other.
//
// A lent chunk is kept by its new holder (the retained tier) as the retained block itself:
// the pool puts a spare chunk of the same size in its place at once, so staging never has
// less than its budget (G6), and takes the lent memory back as a spare when its last holder
// lets go. Spares wait for the next loan, so a steady run of saves neither copies nor maps.
// Lent and spare memory together never exceed the lend limit the pool was given.
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ckptfs {

class ChunkLender {
 public:
  // Lets the chunk that starts at `chunk` (out of the pool now, held by the caller through
  // the chunk's owner) stay out for good. True when a spare took its place in staging; false
  // (nothing changed: the chunk returns to staging as usual) when the lend limit is reached
  // or no memory could be had.
  virtual bool Lend(const void* chunk) = 0;
  // Memory the lender keeps for the next loan (spares), which the borrower's budget counts.
  virtual uint64_t spare_bytes() const = 0;
  // Gives spare memory back to the system until at most `keep_bytes` of it is kept (some
  // memory, such as part of one CUDA allocation, cannot be given back: then more stays).
  virtual void TrimSpares(uint64_t keep_bytes) = 0;

 protected:
  ~ChunkLender() = default;
};

}  // namespace ckptfs
